"""mode.cpu_allocator: glibc keeps freed large blocks, so re-allocating them no longer page-faults."""

import json
import platform
import subprocess
import sys

import pytest

from mode import cpu_allocator
from mode.cpu_allocator import INT_MAX, retain_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
pytestmark = pytest.mark.cpu_only("glibc malloc tuning of host memory: nothing of it runs on a GPU")

# Runs in a fresh interpreter: the tuning changes the whole process, and the pytest process should keep
# glibc's defaults. Minor page faults of one allocate-and-fill of a 128 MiB tensor, before and after.
_PROBE = """
import json, resource, torch
from mode.cpu_allocator import retain_freed_memory

def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(32 * 1024 * 1024).fill_(1.0)  # 128 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_one_step()
default = faults_of_one_step()
tuning = retain_freed_memory()
for _ in range(10):  # the heap grows to its working size (glibc takes 2-6 steps here: more in a lean process,
    faults_of_one_step()  # whose heap is small, e.g. after `import mode`, which loads nothing else)
steps = [faults_of_one_step() for _ in range(5)]
# the median: a small allocation that lands in the freed block now and then splits it, and the next
# 128 MiB then grows the heap once (seen once in a CI run: one step of 32 768 faults among near-zeros)
print(json.dumps(dict(default=default, tuned=sorted(steps)[2], steps=steps, applied=tuning.applied)))
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning needs Linux with glibc")
def test_retained_memory_is_not_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    assert faults["applied"]
    assert faults["default"] > 20_000  # 32 768 pages of 4 KiB: glibc unmapped the block and maps it afresh
    assert faults["tuned"] < 0.05 * faults["default"], faults


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_allocator.platform, "libc_ver", lambda: ("", ""))
    tuning = retain_freed_memory()
    assert not tuning.applied and "glibc" in tuning.reason


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(top_pad=-1), ValueError, r"top_pad=-1: must be >= 0"),
        (dict(mmap_threshold=INT_MAX + 1), ValueError, r"mmap_threshold=2147483648: must be <= 2147483647"),
        (dict(trim_threshold=1.5), TypeError, r"trim_threshold=1.5: must be an int"),
        (dict(mmap_threshold=True), TypeError, r"mmap_threshold=True: must be an int"),
    ],
)
def test_bad_values_name_the_field(kwargs, err, match):
    with pytest.raises(err, match=match):
        retain_freed_memory(**kwargs)
