"""Programmatic dependent launch (``graph.pdl``, ``kernels/gemm.pdl_launch``): a kernel launched
early must wait for the one before it before it touches memory. The interpreter cannot run the
wait (tests/gpu checks the bits on the H200), so these check the invariant in the source: every
fused kernel that takes ``PDL`` waits first, and the launch flag only travels with it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

KERNELS = Path(__file__).resolve().parents[2] / "runtime" / "breezert" / "kernels"


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def is_jit(dec: ast.expr) -> bool:
        target = dec.func if isinstance(dec, ast.Call) else dec
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    return [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and any(is_jit(d) for d in node.decorator_list)]


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def test_every_kernel_that_takes_pdl_waits_before_anything_else() -> None:
    kernels = []
    for path in sorted(KERNELS.glob("*.py")):
        for fn in _jit_functions(ast.parse(path.read_text())):
            if fn.name == "pdl_wait" or "PDL" not in [a.arg for a in fn.args.args]:
                continue
            kernels.append(f"{path.name}:{fn.name}")
            first = _first_statement(fn)
            assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call), fn.name
            call = first.value
            assert isinstance(call.func, ast.Name) and call.func.id == "pdl_wait", (
                f"{path.name}:{fn.name} must call pdl_wait(PDL) first")
            assert [ast.unparse(a) for a in call.args] == ["PDL"], fn.name
    # the chains: depth (q/k/v, attention), DECODE (attention, combine), PREFILL (k/v write,
    # attention), shared GEMMs (3) and the norm apart (``Tiles.prenorm``), text encoder (join,
    # attention, gate/up)
    assert len(kernels) == 13, kernels


def test_the_launch_flag_travels_only_with_the_wait() -> None:
    from breezert.kernels.gemm import Tiles, pdl_launch

    assert pdl_launch(True) == {"launch_pdl": True, "PDL": True}
    assert Tiles(pdl=True).launch("gate")["launch_pdl"] is True
    assert Tiles(pdl=True).launch("split")["PDL"] is True
    assert Tiles().launch("qkv")["launch_pdl"] is False
    for path in sorted(KERNELS.glob("*.py")):
        text = path.read_text()
        uses = text.count("launch_pdl")
        assert uses == (1 if path.name == "gemm.py" else 0), (
            f"{path.name}: pass launch_pdl only through gemm.pdl_launch / Tiles.launch")


def test_pdl_is_refused_before_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU older than compute capability 9.0 the switch fails up front, naming itself."""
    import torch

    from breezert.worker.compile import check_pdl_supported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"graph\.pdl.*A100 is 8\.0"):
        check_pdl_supported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_pdl_supported(torch.device("cuda"))  # Hopper: accepted
    check_pdl_supported(torch.device("cpu"))  # the config refuses CUDA-only switches on CPU


@pytest.mark.parametrize("pdl", [False, True])
def test_pdl_chains_depth_and_text_encoder_only(
        monkeypatch: pytest.MonkeyPatch, pdl: bool) -> None:
    """``graph.pdl`` reaches the depth and text-encoder kernels; the DECODE and PREFILL steps
    take no PDL argument (on the H200 DECODE was slower with it)."""
    import inspect

    import torch

    from breezert.config import EngineConfig, GraphConfig
    from breezert.runtime_setup import load_engine_checkpoint
    from breezert.worker import model_runner

    seen: dict[str, set[bool]] = {}
    for name in ("depth_fn", "text_encode_fn"):
        def spy(*args, _real=getattr(model_runner, name),  # type: ignore[no-untyped-def]
                _name=name, **kwargs):
            seen.setdefault(_name, set()).add(args[-1])  # each one's last positional: its pdl
            return _real(*args[:-1], False, **kwargs)  # a CPU build: no fused kernels anyway
        monkeypatch.setattr(model_runner, name, spy)
    ckpt = load_engine_checkpoint(EngineConfig.from_dict({"model": {"preset": "tiny"}}).model)
    with torch.inference_mode():
        model_runner.ModelRunner(ckpt, max_slots=2, num_blocks=64, block_size=16,
                                 graph=GraphConfig(pdl=pdl))
    assert seen == {"depth_fn": {pdl}, "text_encode_fn": {pdl}}
    assert "pdl" not in inspect.signature(model_runner.decode_fn).parameters
    assert "pdl" not in inspect.signature(model_runner.prefill_fn).parameters
