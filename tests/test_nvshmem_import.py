"""CPU tier: the NVSHMEM modules import and fail cleanly without a GPU / nvshmem4py.

Also checks, without a GPU, what can be checked: the wrappers' Triton front end (TTIR with the
right NVSHMEM symbols and argument types), the bitcode search, and the module-init hook logic
(with a fake init function).
"""
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
import triton.language as tl

import ditron_ops.language.nvshmem as nvs
import ditron_ops.runtime.nvshmem_modules as modules
from ditron_ops.errors import DitronError
from ditron_ops.runtime import nvshmem_backend as backend


def test_modules_import_and_export():
    for name in nvs.__all__:
        assert hasattr(nvs, name), name
    for name in backend.__all__:
        assert hasattr(backend, name), name
    # NVSHMEM header values (PyTorch's docstrings list different, wrong ones).
    assert [int(c) for c in (nvs.SIGNAL_SET, nvs.SIGNAL_ADD)] == [9, 10]
    cmps = (nvs.CMP_EQ, nvs.CMP_NE, nvs.CMP_GT, nvs.CMP_LE, nvs.CMP_LT, nvs.CMP_GE)
    assert [int(c) for c in cmps] == [0, 1, 2, 3, 4, 5]
    assert backend.NvshmemGroup.backend == "nvshmem"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_nvshmem_not_available_without_cuda():
    assert backend.nvshmem_available() is False


def test_init_without_torch_distributed_raises_value_error():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        backend.init_nvshmem()


def test_init_without_cuda_or_nvshmem4py_raises_ditron_error(tmp_path):
    if backend.nvshmem_available():
        pytest.skip("CUDA and nvshmem4py are present (the GPU smoke test covers init)")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(DitronError, match="CUDA device|nvshmem4py"):
            backend.init_nvshmem()
        assert backend._owner is None
    finally:
        dist.destroy_process_group()


def test_bitcode_path_explicit_env_and_missing(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    bc = lib / "libnvshmem_device.bc"
    bc.write_bytes(b"BC")
    assert nvs.bitcode_path(str(lib)) == str(bc)
    assert nvs.bitcode_path(str(bc)) == str(bc)
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(lib))
    assert nvs.bitcode_path() == str(bc)
    assert nvs.extern_libs() == {"libnvshmem_device": str(bc)}
    with pytest.raises(DitronError, match="not found"):
        nvs.bitcode_path(str(tmp_path / "nowhere"))


_SIGNATURE = {"sym_ptr": "*u8", "src_ptr": "*u8", "out_ptr": "*i64", "nbytes": "i64", "pe": "i32"}


def _ttir(body) -> str:
    """TTIR of ``body`` compiled for sm_90 (no GPU, no bitcode needed at this stage)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)
    be = make_backend(target)
    options = be.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    be.load_dialects(ctx)
    src = ASTSource(JITFunction(body), _SIGNATURE)
    return str(src.make_ir(target, options, be.get_codegen_implementation(options),
                           be.get_module_map(), ctx))


def _ttir_child_main() -> None:
    """Runs in a fresh interpreter: Triton interpreter tests in this process patch tl globally."""
    out = {"wrappers": _ttir(_all_wrappers)}
    try:
        _ttir(_block_put)
        out["block_error"] = ""
    except Exception as exc:  # noqa: BLE001
        out["block_error"] = str(exc)
    print("TTIR " + json.dumps(out))


@pytest.fixture(scope="module")
def ttir():
    code = ("import importlib.util as u; s = u.spec_from_file_location('nvshmem_ttir', %r); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m._ttir_child_main()" % __file__)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TTIR ")]
    if proc.returncode != 0 and "make_ir" in proc.stderr and "TypeError" in proc.stderr:
        pytest.skip("ASTSource.make_ir has another signature in this Triton")
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][5:])


def _all_wrappers(sym_ptr, src_ptr, out_ptr, nbytes, pe):
    tl.store(out_ptr, nvs.my_pe() + nvs.n_pes())
    tl.store(out_ptr + 1, nvs.ptr(sym_ptr, pe))
    nvs.putmem_signal_nbi_block(sym_ptr + 64, src_ptr, nbytes, sym_ptr, 1, nvs.SIGNAL_SET, pe)
    nvs.putmem_nbi_block(sym_ptr + 64, src_ptr, nbytes, pe)
    nvs.quiet()
    nvs.fence()
    nvs.signal_op(sym_ptr, 2, nvs.SIGNAL_ADD, pe)
    tl.store(out_ptr + 2, nvs.signal_wait_until(sym_ptr, nvs.CMP_GE, 1))
    nvs.barrier_all()


def test_wrappers_lower_to_nvshmem_externs(ttir):
    text = ttir["wrappers"]
    found = {m.group(1): (m.group(2), m.group(3)) for m in
             re.finditer(r'symbol = "(\w+)"\} : \(([^)]*)\) -> (\w+)', text)}
    assert found == {
        "nvshmem_my_pe": ("", "i32"),
        "nvshmem_n_pes": ("", "i32"),
        "nvshmem_ptr": ("i64, i32", "i64"),
        "nvshmemx_putmem_signal_nbi_block": ("i64, i64, i64, i64, i64, i32, i32", "i32"),
        "nvshmemx_putmem_nbi_block": ("i64, i64, i64, i32", "i32"),
        "nvshmem_quiet": ("", "i32"),
        "nvshmem_fence": ("", "i32"),
        "nvshmemx_signal_op": ("i64, i64, i32, i32", "i32"),
        "nvshmem_signal_wait_until": ("i64, i32, i64", "i64"),
        "nvshmemx_barrier_all_block": ("", "i32"),
    }
    assert "pure = true" not in text


def _block_put(sym_ptr, src_ptr, out_ptr, nbytes, pe):
    nvs.putmem_nbi_block(sym_ptr + tl.arange(0, 4), src_ptr, nbytes, pe)


def test_block_argument_is_rejected(ttir):
    assert "dst must be a scalar" in ttir["block_error"]


@pytest.fixture
def fresh_hook_state(monkeypatch):
    calls = []

    def fake_init(module):
        calls.append(module)
        return 0

    monkeypatch.setattr(modules, "_module_init_fn", fake_init)
    monkeypatch.setattr(modules, "_runtime_live", False)
    monkeypatch.setattr(modules, "_initialized", {})
    monkeypatch.setattr(modules, "_pending", {})
    monkeypatch.setattr(modules, "_marked_kernels", set())
    monkeypatch.setattr(modules, "_hook_kind", None)
    return calls


def _ptx(tmp_path, name, uses_nvshmem):
    path = tmp_path / f"{name}.ptx"
    body = ".visible .const .align 8 .b8 nvshmemi_device_state_d[776];" if uses_nvshmem else ""
    path.write_text(f"// ptx of {name}\n{body}\n")
    return {f"{name}.ptx": str(path), f"{name}.json": str(tmp_path / "unused.json")}


def test_module_init_hook_logic(tmp_path, fresh_hook_state):
    calls = fresh_hook_state
    # Loaded before NVSHMEM is up: the launch fails clearly, the module waits for init.
    with pytest.raises(DitronError, match="init_nvshmem"):
        modules._on_kernel_load(111, None, "uses", _ptx(tmp_path, "uses", True))
    modules._on_kernel_load(222, None, "plain", _ptx(tmp_path, "plain", False))
    assert calls == [] and modules._pending == {111: "uses"}
    nvs.on_nvshmem_init()
    assert calls == [111]
    modules._on_kernel_load(333, None, "uses", _ptx(tmp_path, "uses", True))
    modules._on_kernel_load(333, None, "uses", _ptx(tmp_path, "uses", True))  # once per module
    assert calls == [111, 333]
    # No readable PTX: only kernels marked with requires_nvshmem are inited.
    modules._on_kernel_load(444, None, "unmarked", {})
    modules._marked_kernels.add("marked")
    modules._on_kernel_load(555, None, "marked", {})
    assert calls == [111, 333, 555]
    # A finalize + init cycle re-inits every module (Triton does not reload them).
    nvs.on_nvshmem_finalize()
    nvs.on_nvshmem_init()
    assert sorted(calls[3:]) == [111, 333, 555]


def test_module_init_failure_is_reported(tmp_path, fresh_hook_state, monkeypatch):
    monkeypatch.setattr(modules, "_module_init_fn", lambda module: 7)
    monkeypatch.setattr(modules, "_runtime_live", True)
    with pytest.raises(DitronError, match="status 7"):
        modules._on_kernel_load(1, None, "k", _ptx(tmp_path, "k", True))


def test_install_hook_prefers_kernel_load_end_hook(fresh_hook_state):
    import triton

    chain = getattr(triton.knobs.runtime, "kernel_load_end_hook", None)
    if chain is None or not hasattr(chain, "add"):
        pytest.skip("Triton < 3.5 has no kernel_load_end_hook")
    try:
        assert nvs.install_module_init_hook() == "kernel_load_end_hook"
        assert nvs.install_module_init_hook() == "kernel_load_end_hook"
        assert chain.calls.count(modules._on_kernel_load) == 1
    finally:
        chain.remove(modules._on_kernel_load)


def test_install_hook_chains_post_compile_hook(fresh_hook_state, monkeypatch):
    import triton

    seen = []
    previous = lambda **kw: seen.append(("previous", kw["key"])) or "kept"  # noqa: E731
    monkeypatch.setattr(triton.knobs, "runtime", types.SimpleNamespace(jit_post_compile_hook=previous))
    monkeypatch.setattr(modules, "_on_post_compile", lambda **kw: seen.append(("ours", kw["key"])))
    assert nvs.install_module_init_hook() == "jit_post_compile_hook"
    hook = triton.knobs.runtime.jit_post_compile_hook
    assert nvs.install_module_init_hook() == "jit_post_compile_hook"
    assert triton.knobs.runtime.jit_post_compile_hook is hook  # idempotent, not chained twice
    assert hook(key="k", fn=None, compile={}) == "kept"
    assert seen == [("previous", "k"), ("ours", "k")]


def test_requires_nvshmem_marks_kernel(fresh_hook_state, monkeypatch):
    monkeypatch.setattr(modules, "install_module_init_hook", lambda: "stub")

    def my_kernel():
        pass

    wrapped = types.SimpleNamespace(fn=my_kernel)
    assert nvs.requires_nvshmem(wrapped) is wrapped
    assert "my_kernel" in modules._marked_kernels
    with pytest.raises(TypeError):
        nvs.requires_nvshmem(42)


def test_env_module_is_the_only_env_reader():
    src = open(nvs.__file__).read() + open(backend.__file__).read()
    assert "os.environ" not in src and "getenv" not in src
    assert os.path.basename(nvs.__file__) == "nvshmem.py"


class _FakeUniqueId:
    def __init__(self, data):
        self._data = data


class _FakeNvshmemCore:
    """Stands in for ``nvshmem.core``: a unique id is a 1-element recarray, as in nvshmem4py."""

    @staticmethod
    def get_unique_id(empty=False):
        dtype = np.dtype([("version", "<i4"), ("internal", "u1", (124,))])
        data = np.zeros(1, dtype=dtype).view(np.recarray)
        if not empty:
            data.version[0] = 7
            data.internal[0][:] = np.arange(124, dtype=np.uint8) + 3
        return _FakeUniqueId(data)


def _unique_id_and_layout(group):
    uid = backend._broadcast_unique_id(_FakeNvshmemCore, group.rank, group.pg,
                                       torch.device("cpu"))
    raw = bytes(np.ndarray.view(uid._data, np.ndarray).view(np.uint8))
    return raw, backend._host_layout(group.pg, group.rank, torch.device("cpu"))


def test_unique_id_broadcast_and_host_layout_over_gloo():
    from ditron_ops.testing import run_gloo

    results = run_gloo(_unique_id_and_layout, 2)
    reference = _FakeNvshmemCore.get_unique_id()
    expected = bytes(np.ndarray.view(reference._data, np.ndarray).view(np.uint8))
    assert [raw for raw, _ in results] == [expected, expected]
    assert [layout for _, layout in results] == [(0, 2), (1, 2)]
