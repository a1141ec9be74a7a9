"""Ending a distributed run cleanly: `end_distributed`, the last call of every rank.

A script that finishes its work and leaves its process group to interpreter exit can still die with SIGABRT
("terminate called without an active exception"), and every scheduler (SLURM, Kubernetes, torchrun) marks the job
failed. The group's C++ worker threads (gloo's, NCCL's watchdog) then outlive the interpreter's normal life: a
worker that drops the last reference to a tensor of a finished `Work` has to take the GIL to free its Python
object, and once the interpreter has started finalising, taking the GIL ends the thread with `pthread_exit`, whose
unwinding through a C++ ``noexcept`` frame calls `std::terminate` (pytorch/pytorch#179291 describes it; torch
does not register an exit hook for it). Ranks that reach exit at different times make it likelier, and so does a
loaded machine. The Trainer never destroys the group it (through accelerate) created.

`end_distributed` ends the run as torch recommends: a barrier (every rank is past its last collective, and gloo's
barrier waits for this rank's earlier asynchronous work), a garbage collection (finished `Work` objects held in
reference cycles, by FSDP2 or DDP hooks for example, let go of their tensors now, on this thread), then
`torch.distributed.destroy_process_group()`, which joins the group's threads while the interpreter is whole.
The packer starts no thread of its own.

That is not always enough: a 2-process script can still abort after `end_distributed`, rarely (measured:
docs/recipes.md). Whatever thread of torch's or a library's is still inside a C++ call then, the abort can only
happen in the interpreter's finalization. `end_process` skips it the way `multiprocessing` ends every child
process: run the `atexit` handlers (logging's, multiprocessing's own), flush the standard
streams, then `os._exit`. A script's `if __name__ == "__main__":` block ends with it.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from typing import NoReturn

import torch


def end_distributed() -> None:
    """Barrier, garbage collection, then `torch.distributed.destroy_process_group()`; a no-op without a process group.

    Call it on every rank after the last collective (after `trainer.train()`, `trainer.evaluate()` and
    `trainer.save_model()`), before the script returns::

        trainer.train()
        trainer.save_model()
        hf_packing.end_distributed()
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def end_process(exit_code: int = 0) -> NoReturn:
    """Ends this process without the interpreter's finalization: `atexit` handlers, flushed standard streams, then
    `os._exit(exit_code)` (what `multiprocessing` does at the end of each child process). The last line of a
    training script's ``__main__`` block, after [`end_distributed`]; never call it from code that others import::

        if __name__ == "__main__":
            main()  # ... trainer.save_model(); hf_packing.end_distributed()
            hf_packing.end_process()

    Files a script left open (not closed by a ``with`` block or a handler) are not flushed.
    """
    try:
        atexit._run_exitfuncs()  # logging.shutdown, multiprocessing's children
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed or replaced streams: nothing left to flush
                pass
        os._exit(exit_code)
