"""GPU tier: one-PE NVSHMEM smoke test of the extern path (nvshmem4py init + Triton wrappers).

The body runs in a fresh Python process (this file executed as a script): NVSHMEM can be
initialised and finalized reliably once per process, the module-init hook is process-global,
and a kernel stuck in ``signal_wait_until`` cannot be interrupted, so the parent enforces a hard
timeout by killing the child. The child prints one ``RESULT {json}`` line; the test asserts on it.

What it checks, in order: one-rank gloo world (file:// rendezvous) -> ``init_nvshmem`` (and that
a second compatible call returns the same group, an incompatible one raises) -> a zeroed
symmetric buffer and its pointer table -> a Triton kernel launched with ``extern_libs=`` whose
module the hook initialised: ``my_pe``/``n_pes``, ``ptr(addr, 0)`` equals the local address,
``putmem_signal_nbi_block`` to PE 0 (self) with SIGNAL_SET then SIGNAL_ADD, ``quiet``,
``signal_wait_until(CMP_GE)`` -> data and signal read back on the host -> ``finalize_nvshmem``
frees everything (workspace included) and unregisters the group -> ``destroy_process_group``.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import ditron_ops.language.nvshmem as nvs
from ditron_ops.runtime import nvshmem_backend, nvshmem_modules

pytestmark = [pytest.mark.gpu, pytest.mark.nvshmem]

DATA_OFFSET = 256      # bytes; the signal word is at offset 0 of the symmetric buffer
NBYTES = 1000          # not a multiple of 16 on purpose
CHILD_TIMEOUT_S = 420  # first compile links the 31 MB NVSHMEM bitcode (~10 s on the H200)


@triton.jit(do_not_specialize=["nbytes", "sig_value", "sig_op", "wait_value"])
def _smoke_kernel(sym_ptr, src_ptr, out_ptr, nbytes, sig_value, sig_op, wait_value,
                  DATA_OFF: tl.constexpr):
    pe = nvs.my_pe()
    tl.store(out_ptr + 0, pe.to(tl.int64))
    tl.store(out_ptr + 1, nvs.n_pes().to(tl.int64))
    tl.store(out_ptr + 2, nvs.ptr(sym_ptr.to(tl.int64), 0))   # int64 address form
    tl.store(out_ptr + 3, nvs.ptr(sym_ptr, pe))                # pointer form
    nvs.putmem_signal_nbi_block(sym_ptr + DATA_OFF, src_ptr, nbytes, sym_ptr, sig_value, sig_op, 0)
    nvs.quiet()
    tl.store(out_ptr + 4, nvs.signal_wait_until(sym_ptr, nvs.CMP_GE, wait_value))


def _launch(buf, src, out, sig_value, sig_op, wait_value):
    return _smoke_kernel[(1,)](buf.local, src, out, src.numel(), sig_value, sig_op, wait_value,
                               DATA_OFF=DATA_OFFSET, num_warps=4, extern_libs=nvs.extern_libs())


def _child(tmpdir: str) -> dict:
    import torch.distributed as dist

    from ditron_ops.errors import DitronError
    from ditron_ops.runtime.group import resolve_group

    res: dict = {}
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}",
                            rank=0, world_size=1)
    try:
        group = nvshmem_backend.init_nvshmem()
        res.update(backend=group.backend, rank=group.rank, world=group.world_size,
                   name=group.group_name, version=group.libnvshmem_version,
                   same_again=nvshmem_backend.init_nvshmem() is group,
                   resolved=resolve_group(group.group_name) is group)
        try:
            nvshmem_backend.init_nvshmem(timeout_s=group.timeout_s + 1.0)
            res["incompatible_raises"] = False
        except DitronError:
            res["incompatible_raises"] = True
        res["hook"] = nvs.install_module_init_hook()   # installed by init; idempotent

        ws = group.workspace("smoke")                     # freed by finalize_nvshmem
        buf = group.alloc_symmetric(DATA_OFFSET + NBYTES)
        res["zeroed"] = bool((buf.local == 0).all())
        res["table_ok"] = buf.ptr_table.tolist() == [buf.local.data_ptr()]
        src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=group.device)
        out = torch.full((5,), -1, dtype=torch.int64, device=group.device)

        kernel = _launch(buf, src, out, 42, int(nvs.SIGNAL_SET), 42)
        torch.cuda.synchronize()
        res["out_set"] = out.tolist()
        res["local_addr"] = buf.local.data_ptr()
        res["data_set_ok"] = torch.equal(buf.local[DATA_OFFSET:DATA_OFFSET + NBYTES], src)
        res["signal_set"] = int(buf.local[:8].view(torch.int64).item())
        res["module_inited"] = int(kernel.module) in nvshmem_modules._initialized

        src2 = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device=group.device)
        _launch(buf, src2, out, 5, int(nvs.SIGNAL_ADD), 47)
        torch.cuda.synchronize()
        res["out_add"] = out.tolist()
        res["data_add_ok"] = torch.equal(buf.local[DATA_OFFSET:DATA_OFFSET + NBYTES], src2)
        res["signal_add"] = int(buf.local[:8].view(torch.int64).item())
        group.barrier()

        del ws
        nvshmem_backend.finalize_nvshmem()
        res["freed_all"] = not group._live and not group._workspaces and buf.handle is None
        try:
            resolve_group(group.group_name)
            res["unregistered"] = False
        except ValueError:
            res["unregistered"] = True
        res["owner_reset"] = nvshmem_backend._owner is None
    finally:
        nvshmem_backend.finalize_nvshmem()   # no-op when already finalized
        dist.destroy_process_group()
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None
                    or not nvshmem_backend.nvshmem_available(),
                    reason="needs nvshmem4py (pip install 'ditron_ops[cu13]')")
def test_nvshmem_one_pe_smoke(tmp_path):
    try:
        nvs.bitcode_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVSHMEM device bitcode not found: {exc}")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(nvs.__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"NVSHMEM smoke child hung for {CHILD_TIMEOUT_S} s (killed). A wrong signal "
                    f"constant makes signal_wait_until spin forever.\nstderr:\n{exc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"child failed (rc={proc.returncode})\nstdout:\n{proc.stdout[-4000:]}\n"
        f"stderr:\n{proc.stderr[-8000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    print("nvshmem smoke:", r)

    assert (r["backend"], r["rank"], r["world"]) == ("nvshmem", 0, 1)
    assert r["same_again"] and r["resolved"] and r["incompatible_raises"]
    assert r["hook"] in ("kernel_load_end_hook", "jit_post_compile_hook")
    assert r["zeroed"] and r["table_ok"]
    addr = r["local_addr"]
    assert r["out_set"] == [0, 1, addr, addr, 42], r["out_set"]
    assert r["data_set_ok"] and r["signal_set"] == 42
    assert r["module_inited"]
    assert r["out_add"] == [0, 1, addr, addr, 47], r["out_add"]
    assert r["data_add_ok"] and r["signal_add"] == 47
    assert r["freed_all"] and r["unregistered"] and r["owner_reset"]


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child(sys.argv[1])), flush=True)
