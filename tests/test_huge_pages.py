"""torch's large CPU tensors on transparent huge pages, as the CLI and the Triton model set up."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PROBE = ("from icekv.devices import use_huge_pages; use_huge_pages(); import torch; x = torch.ones(64 << 20); "
         "print(next(line.split()[1] for line in open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages')))")


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="huge pages here are not per allocation (transparent_hugepage is not madvise)")
@pytest.mark.parametrize("setting, huge", [(None, True), ("0", False)], ids=["default", "turned-off"])
def test_large_tensors_use_huge_pages_unless_the_environment_says_no(setting, huge):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert (int(probe.stdout) > 0) == huge, probe.stdout
