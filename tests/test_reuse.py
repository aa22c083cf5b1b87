"""torch's freed CPU tensors kept for reuse (`core/reuse.cpp`, installed by `process.reuse_freed_memory`).

Each test runs in a fresh child process (the allocator is the process's for good) and holds it to the kernel: the
page faults it counts (`ru_minflt`) and the peak resident set it keeps (VmHWM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the reuse allocator is Linux's (mmap, mremap)")

PRELUDE = """
import json, random, resource, torch
from remat.core import process
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def made(nbytes): return torch.ones(nbytes // 4)  # every page written
"""


def _child(body: str, env: dict[str, str] | None = None) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_freed_tensor_is_used_again_without_faulting_its_pages_in():
    """Same size: its own pages. Smaller: a larger freed block's first pages (its tail kept). Larger: the largest
    freed block grown, its pages moved along, the rest faulted in. After `trim_heap`, every page is fresh."""
    got = _child("""
        process.reuse_freed_memory()
        out = {}
        a = made(4 << 20); at = a.data_ptr(); del a
        f = faults(); b = made(4 << 20); out["same"] = faults() - f; out["same_place"] = b.data_ptr() == at; del b
        f = faults(); c = made(1 << 20); out["smaller"] = faults() - f; del c
        f = faults(); d = made(6 << 20); out["larger"] = faults() - f; del d
        out["kept"] = process.kept_bytes()
        process.trim_heap()
        out["kept_after_trim"] = process.kept_bytes()
        f = faults(); e = made(4 << 20); out["fresh"] = faults() - f
        print(json.dumps(out))
    """)
    assert got["same_place"]
    assert got["same"] < 16 and got["smaller"] < 16, got  # 1024 and 256 pages, none faulted
    assert 512 <= got["larger"] <= 768 + 16, got  # 6 MiB from the 3 MiB tail: 768 pages fresh (the 1 MiB unmapped)
    assert got["kept"] == 6 << 20 and got["kept_after_trim"] == 0, got
    assert got["fresh"] >= 1024, got  # every page of a block nothing freed gives


def test_the_resident_set_never_grows_past_the_most_ever_live():
    """A random run of tensors made and freed (256 KiB to 8 MiB, every page written): the kernel's peak resident set
    above the start stays within what was live at most (page-rounded) and 2 MiB of the process's own (the same run
    giving every block back grows 1.3 MiB past it too), while most pages are used again (not faulted in: 22 %)."""
    got = _child("""
        process.reuse_freed_memory()
        rng = random.Random(0)
        held, live, most, pages = [], 0, 0, 0
        process.trim_heap(); process.reset_process_peak()
        start, f = process.process_peak()["rss"], faults()
        for _ in range(3000):
            if held and (rng.random() < 0.5 or live > 64 << 20):
                t = held.pop(rng.randrange(len(held))); live -= -(-t.nbytes // 4096) * 4096; del t
            else:
                nbytes = rng.randrange(256 << 10, 8 << 20) // 4 * 4
                held.append(made(nbytes)); live += -(-nbytes // 4096) * 4096; pages += -(-nbytes // 4096)
                most = max(most, live)
        print(json.dumps({"grew": process.process_peak()["rss"] - start, "most": most, "pages": pages,
                          "faults": faults() - f}))
    """)
    assert got["grew"] <= got["most"] + (2 << 20), got
    assert got["faults"] < got["pages"] / 3, got


def test_without_a_cpp_compiler_freed_tensors_go_back_to_the_kernel(tmp_path):
    """No C++ compiler: said once, as a note; torch allocates as before, each block fresh pages."""
    got = _child("""
        import warnings
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            process.reuse_freed_memory()
        a = made(4 << 20); del a
        f = faults(); b = made(4 << 20)
        print(json.dumps({"said": [str(w.message) for w in said], "kept": process.kept_bytes(), "fresh": faults() - f}))
    """, env={"PATH": str(tmp_path), "CXX": "", "XDG_CACHE_HOME": str(tmp_path)})
    assert got["said"] == ["no C++ compiler (c++): freed tensors go back to the kernel, slower"], got
    assert got["kept"] == 0 and got["fresh"] >= 1024, got


def test_memory_the_kernel_will_not_map_is_torchs_out_of_memory_error_and_the_process_goes_on():
    got = _child("""
        process.reuse_freed_memory()
        a = made(4 << 20); del a  # kept: the failed request tries to grow it
        try:
            torch.empty(1 << 48, dtype=torch.uint8)
        except torch.OutOfMemoryError as e:
            said = str(e)
        b = made(4 << 20)
        print(json.dumps({"said": said, "sum": float(b.sum())}))
    """)
    assert got["said"].startswith("CPU allocator (remat): not enough memory: you tried to allocate 281474976710656")
    assert got["sum"] == 1 << 20


def test_a_job_gives_back_what_it_kept_when_it_ends():
    """A server lives on after a `/train` job: the tensors its steps freed are kept while it trains, then unmapped."""
    got = _child("""
        from remat.base.settings import TrainSettings
        from remat.training.train import Hooks, finetune
        during = []
        s = TrainSettings(model="tiny-llama", ctx=1024, batch=2, steps=2, dtype="float32")
        finetune(s, progress=False, hooks=Hooks(on_step=lambda event: during.append(process.kept_bytes())))
        print(json.dumps({"during": during, "after": process.kept_bytes()}))
    """)
    assert min(got["during"]) > 1 << 20 and got["after"] == 0, got
