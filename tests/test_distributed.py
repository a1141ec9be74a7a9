"""`hf_packing.training.distributed`: the last calls of a distributed run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_end_process_runs_atexit_handlers_flushes_and_exits_with_the_code(tmp_path):
    """`end_process(3)`: atexit handlers run (in reverse order of registration), buffered output is written, the exit
    code is 3, and nothing after it runs. Control: the same script ending normally exits 0 with the same output."""
    script = tmp_path / "end.py"
    body = f"""
import atexit, sys
sys.path.insert(0, {str(ROOT)!r})
from hf_packing.training.distributed import end_process
atexit.register(lambda: print("first registered", flush=True))
atexit.register(lambda: print("last registered", flush=True))
sys.stdout.write("buffered, no newline")  # a pipe: block-buffered, written only by a flush
if {{end}}:
    end_process(3)
    print("after end_process")
"""
    for end, code in ((True, 3), (False, 0)):
        script.write_text(body.format(end=end))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "buffered, no newlinelast registered\nfirst registered\n", proc.stdout
        assert "after end_process" not in proc.stdout
