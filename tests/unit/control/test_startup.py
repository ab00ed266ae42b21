"""A restarted coordinator is on the recovery path: it must listen without importing torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from unbroken.cli.main import READY_PREFIX

NO_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("the coordinator imported torch")
            return None

    sys.meta_path.insert(0, NoTorch())
    from unbroken.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_coordinator_listens_without_importing_torch() -> None:
    # Every policy string parsed at start-up (codec, rule, fragments) is given, so that
    # their checks run in the process too.
    args = ["coordinator", "--host", "127.0.0.1", "--port", "0", "--codec", "topk:0.1"]
    args += ["--aggregate", "trimmed:0.2", "--fragments", "3,2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", NO_TORCH, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(READY_PREFIX):
                break
        else:
            raise AssertionError("the coordinator exited before listening:\n" + "".join(seen))
    finally:
        proc.kill()
        proc.wait(timeout=10)
