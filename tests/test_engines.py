"""Every engine of recipes/accelerate/ trains through recipes/train.py, and the cost model counts whole parameters.

Fast (default suite): under ZeRO-3 and FSDP2 the cost model (`ModelFlops`) reads full parameter shapes from the
parameters' attributes (fakes of DeepSpeed's ``ds_shape`` / ``ds_numel`` partitions and of FSDP2's DTensor shards), and
`model_flops` builds its meta model outside a registered ZeRO-3 config; the recipe's fallback refusal.

Slow (``-m "multiproc and slow"``, about 5 minutes on 2 cores): ``accelerate launch`` of DDP, DeepSpeed ZeRO-2, ZeRO-3,
FSDP2 and a two-"node" FSDP2 launch on 2 CPU processes (gloo), 3 steps of tiny_cpu each, compared with DDP. CPU
processes engage FSDP and DeepSpeed only through the test-only shim tests/cpu_as_gpu/sitecustomize.py (accelerate
otherwise runs them as plain DDP on CPU, which the recipe refuses: the negative control). DeepSpeed runs its CPU
accelerator (``DS_ACCELERATOR=cpu``) and JIT-builds its shared-memory op once into
``$TMPDIR/hf_packing_torch_extensions``
(about 2 minutes the first time, never in the home directory).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, write_llava_jsonl

RECIPES = ROOT / "recipes"
SHIM = ROOT / "tests" / "cpu_as_gpu"
STEPS = 3


# ------------------------------------------------------------------------------------------ cost model, fast
def _tiny_model():
    from hf_packing.testing.tiny import build_tiny_model

    torch.manual_seed(0)
    return build_tiny_model("qwen2_5_vl")


def test_zero3_partitions_are_counted_by_ds_shape_not_their_empty_local_shape():
    """A ZeRO-3 parameter holds a local tensor of shape ``(0,)`` (its partition lives in ``ds_tensor``) and the whole
    shape in ``ds_shape`` / ``ds_numel``: the cost model counts the whole shape, as of the unpartitioned model."""
    from hf_packing.ops.flops import ModelFlops

    model = _tiny_model()
    full = ModelFlops.from_model(model)
    for p in model.parameters():  # what deepspeed.zero.Init leaves on every rank
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert all(p.shape == (0,) for p in model.parameters())
    assert ModelFlops.from_model(model) == full
    for p in model.parameters():  # negative control: the local shapes alone count nothing
        del p.ds_shape, p.ds_numel
    counted = ModelFlops.from_model(model)
    assert counted.text_params < full.text_params and counted.vision_blocks == 0 < full.vision_blocks


def test_fsdp2_dtensor_shards_are_counted_by_their_global_shape():
    """An FSDP2 parameter is a DTensor sharded on dim 0: its ``shape`` is the global one, its local shard a slice.
    Here each local shard is half the rows (world 2, rank 0), built on a 1-process gloo mesh with the global shape
    given, as ``fully_shard`` makes them; the cost model equals the unsharded model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hf_packing.ops.flops import ModelFlops

    model = _tiny_model()
    full = ModelFlops.from_model(model)
    assert not dist.is_initialized()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                local = p.detach()[: (p.shape[0] + 1) // 2].clone()
                sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
                setattr(module, name, torch.nn.Parameter(sharded, requires_grad=p.requires_grad))
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        assert sum(p.to_local().numel() for p in params) < sum(p.numel() for p in params)
        assert ModelFlops.from_model(model) == full
    finally:
        dist.destroy_process_group()


def test_model_flops_builds_its_meta_model_outside_a_registered_zero3_config():
    """`TrainingArguments` with a stage-3 DeepSpeed config registers it with transformers; every model transformers
    builds afterwards runs inside ``deepspeed.zero.Init`` (which cannot copy out of meta tensors). `model_flops` builds
    outside it, counts what it counts without the registration, and leaves the registration as it was."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_deepspeed

    from hf_packing.packing import balance
    from hf_packing.testing.tiny import tiny_config

    config = tiny_config("qwen2_5_vl")
    expected = balance.model_flops(config)
    balance._COUNTED.clear()
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    hf_deepspeed.set_hf_deepspeed_config(zero3)
    try:
        assert hf_deepspeed.is_deepspeed_zero3_enabled()  # what makes transformers enter zero.Init
        seen = []
        with balance._outside_zero3_init():
            seen.append(hf_deepspeed.is_deepspeed_zero3_enabled())
        assert seen == [False] and hf_deepspeed.is_deepspeed_zero3_enabled()  # restored
        assert balance.model_flops(config) == expected
        assert balance.WorkCost.from_config(config) == balance.WorkCost.from_flops(expected)
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


# ------------------------------------------------------------------------------------------ the refusal, fast
@pytest.fixture(scope="module")
def train():
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipes_train_engines", RECIPES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_check_engine_refuses_an_engine_the_trainer_did_not_engage(train, monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    plain = SimpleNamespace(
        is_fsdp_enabled=False,
        is_deepspeed_enabled=False,
        accelerator=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU),
        args=SimpleNamespace(device=torch.device("cpu"), use_cpu=True),
    )
    train.check_engine(plain)  # nothing asked for: DDP / one process runs
    for variable, engine in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        with monkeypatch.context() as env:
            env.setenv(variable, "true")
            with pytest.raises(train.SettingError, match=rf"asks for {engine} .* would run MULTI_CPU"):
                train.check_engine(plain)
            flag = "is_fsdp_enabled" if engine == "FSDP" else "is_deepspeed_enabled"
            train.check_engine(SimpleNamespace(**{**vars(plain), flag: True}))  # engaged: no error


# ------------------------------------------------------------------------------------------ launches, slow
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(shim: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([*([str(SHIM)] if shim else []), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(Path(tempfile.gettempdir()) / "hf_packing_torch_extensions"),
    }
    env.pop("HF_PACKING_TEST_CPU_AS_GPU", None)
    if shim:
        env["HF_PACKING_TEST_CPU_AS_GPU"] = "1"
    return env


def _accelerate(config: str, launch: list[str], train_args: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(RECIPES / "accelerate" / config)]
    cmd += [*launch, "--mixed_precision", "no", str(RECIPES / "train.py"), str(RECIPES / "configs/tiny_cpu.yaml")]
    return subprocess.Popen(
        cmd + train_args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, str, str]]:
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            out.append((None, stdout, stderr))
            continue
        out.append((proc.returncode, stdout, stderr))
    return out


class Run:
    """One finished launch: exit status, output, every rank's engine report, the log history and the saved model."""

    def __init__(self, name: str, out: Path, returncode: int | None, stdout: str, stderr: str) -> None:
        self.name, self.out, self.returncode, self.stdout, self.stderr = name, out, returncode, stdout, stderr
        # the ranks share one stdout: a line of one may land inside another's, so find each report anywhere
        reports = re.findall(r"hf_packing engine: (\{[^{}]*\})", stdout)
        self.engines = sorted((json.loads(r) for r in reports), key=lambda e: e["rank"])

    def check_ok(self) -> None:
        assert self.returncode is not None, f"{self.name}: hung past its timeout\n{self.stderr[-3000:]}"
        start = max(self.stderr.find("Traceback"), 0)
        assert self.returncode == 0, f"{self.name}: exit {self.returncode}\n{self.stderr[start:][:6000]}"
        assert "terminate called" not in self.stderr

    @property
    def logs(self) -> list[dict]:
        history = json.loads((self.out / "trainer_state.json").read_text())["log_history"]
        return [h for h in history if "loss" in h]

    def weights(self) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(self.out).state_dict()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(name)``: the launch of that name, run once per module (they share the checkpoint and data)."""
    from hf_packing.testing.tiny import save_tiny_checkpoint

    work = tmp_path_factory.mktemp("engines")
    model_dir = save_tiny_checkpoint("qwen2_5_vl", work / "tiny")
    data = write_llava_jsonl(work / "data")
    common = ["--model_name_or_path", str(model_dir), "--dataset_path", str(data)]
    common += ["--image_root", str(work / "data" / "images"), "--eval_strategy", "no", "--max_steps", str(STEPS)]
    # name: (accelerate config, shim, use_cpu); DDP runs as CPU processes do without any shim (MULTI_CPU)
    plans = {
        "ddp": ("ddp.yaml", False, "true"),
        "zero2": ("deepspeed_zero2.yaml", True, "false"),
        "zero3": ("deepspeed_zero3.yaml", True, "false"),
        "fsdp2": ("fsdp2.yaml", True, "false"),
        "fsdp2_unengaged": ("fsdp2.yaml", False, "false"),  # negative control: no shim, FSDP cannot engage
    }
    done: dict[str, Run] = {}

    def run(name: str) -> Run:
        if name in done:
            return done[name]
        out = work / name
        if name == "two_nodes":  # multi_node.yaml's launch line on each "host", both on 127.0.0.1
            port = str(_free_port())
            flags = ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1"]
            flags += ["--main_process_port", port]
            train_args = [*common, "--output_dir", str(out), "--use_cpu", "false", "--max_steps", "2"]
            procs = [
                _accelerate("multi_node.yaml", [*flags, "--machine_rank", str(rank)], train_args, _env(True))
                for rank in (0, 1)
            ]
            (rc0, out0, err0), (rc1, out1, err1) = _wait(procs, timeout=600)
            done[name] = Run(name, out, rc0 if rc0 else rc1, out0 + out1, err0 + "\n" + err1)
        else:
            config, shim, use_cpu = plans[name]
            train_args = [*common, "--output_dir", str(out), "--use_cpu", use_cpu]
            one_node = ["--num_processes", "2", "--num_machines", "1", "--main_process_port", str(_free_port())]
            ((rc, stdout, stderr),) = _wait([_accelerate(config, one_node, train_args, _env(shim))], timeout=600)
            done[name] = Run(name, out, rc, stdout, stderr)
        print(f"{name}: exit {done[name].returncode}")
        return done[name]

    run.initial = model_dir  # type: ignore[attr-defined]
    return run


def _assert_trains_like_ddp(run: Run, ddp: Run, steps: int = STEPS) -> None:
    """Step-1 loss within 1e-5 (relative), every step's loss close, the telemetry's FLOPs equal, and the weights
    after the run within 1e-4 of DDP's."""
    logs, ref = run.logs, ddp.logs[:steps]
    assert len(logs) == steps and len(ref) == steps
    assert logs[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-5)
    assert [h["loss"] for h in logs] == pytest.approx([h["loss"] for h in ref], rel=1e-4)
    assert [h["packing/flops_per_step"] for h in logs] == [h["packing/flops_per_step"] for h in ref]
    assert all(h["packing/flops_per_step"] > 0 for h in logs)


def _max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.multiproc
@pytest.mark.slow
def test_ddp_trains_and_moves_the_weights(launches):
    """The reference: ddp.yaml on 2 CPU processes (MULTI_CPU, gloo) trains 3 steps and saves a model whose weights
    moved by far more than the 1e-4 the other engines are held to (the weight comparison can fail)."""
    from transformers import AutoModelForImageTextToText

    ddp = launches("ddp")
    ddp.check_ok()
    assert [(e["rank"], e["distributed_type"], e["dtensor_params"]) for e in ddp.engines] == [
        (0, "MULTI_CPU", 0),
        (1, "MULTI_CPU", 0),
    ]
    assert len(ddp.logs) == STEPS
    initial = AutoModelForImageTextToText.from_pretrained(launches.initial).state_dict()
    assert _max_weight_diff(ddp.weights(), initial) > 1e-3


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp2"])
def test_each_engine_engages_and_trains_like_ddp(launches, name):
    if name.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed engines need the hf_packing[deepspeed] extra")
    run, ddp = launches(name), launches("ddp")
    run.check_ok()
    ddp.check_ok()
    assert [e["rank"] for e in run.engines] == [0, 1] and all(e["world_size"] == 2 for e in run.engines)
    for engine in run.engines:
        if name.startswith("zero"):
            assert engine["distributed_type"] == "DEEPSPEED" and engine["zero_stage"] == int(name[-1])
            # ZeRO-3 partitions the parameters (about half the elements per rank), ZeRO-2 keeps them whole
            local, full = engine["local_numel"], engine["full_numel"]
            assert local < 0.6 * full if name == "zero3" else local == full
        else:
            assert engine["distributed_type"] == "FSDP" and engine["dtensor_params"] > 0
            assert engine["local_numel"] < 0.6 * engine["full_numel"]  # every parameter a DTensor shard
    assert sum(e["local_numel"] for e in run.engines) >= run.engines[0]["full_numel"]
    _assert_trains_like_ddp(run, ddp)
    diff = _max_weight_diff(run.weights(), ddp.weights())
    loss, ref = run.logs[0]["loss"], ddp.logs[0]["loss"]
    print(f"{name}: step-1 loss {loss:.7f} (DDP {ref:.7f}, rel {abs(loss - ref) / ref:.1e}), weights within {diff:.1e}")
    assert diff <= 1e-4


@pytest.mark.multiproc
@pytest.mark.slow
def test_fsdp_that_cannot_engage_is_refused_before_training(launches):
    """Negative control of the engagement check: fsdp2.yaml on CPU processes without the shim (what accelerate does
    on any CPU launch) would train as plain DDP; the recipe stops before training and names the reason."""
    run = launches("fsdp2_unengaged")
    assert run.returncode not in (0, None), run.stderr[-3000:]
    assert "asks for FSDP (ACCELERATE_USE_FSDP=true)" in run.stderr
    assert not run.engines and not (run.out / "model.safetensors").exists()


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_nodes_train_like_one(launches):
    """multi_node.yaml as two `accelerate launch` (``--machine_rank`` 0 and 1, one process each, on 127.0.0.1): FSDP2
    over both "hosts" trains 2 steps with the losses and FLOPs of the one-node FSDP2 run's first 2 steps."""
    run, one_node = launches("two_nodes"), launches("fsdp2")
    run.check_ok()
    one_node.check_ok()
    assert [(e["rank"], e["distributed_type"], e["world_size"]) for e in run.engines] == [
        (0, "FSDP", 2),
        (1, "FSDP", 2),
    ]
    _assert_trains_like_ddp(run, one_node, steps=2)
