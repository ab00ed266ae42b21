"""A node that is also a coordinator candidate (``unbroken node --etcd ... --coordinate``).

The candidate is a child process, ``unbroken coordinator --etcd ...``: its own interpreter
and event loop, so the coordinator's loop never waits on the training thread's GIL and the
node's steps never wait on the coordinator. It stands by until etcd elects it; the node
finds the leader through etcd like any other node, whether it is its own child or not.

It lives and dies with the node: it watches its parent and, once the node is gone (even
SIGKILLed), resigns at once, so another node's candidate leads without waiting out the
lease. A frozen node's candidate keeps serving: it is a separate process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from unbroken.config import NodeConfig
from unbroken.control.auth import ENV_TOKEN

log = logging.getLogger(__name__)


class Candidate:
    """The node's coordinator child process."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.host = config.gloo_host or "0.0.0.0"

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            sys.executable, "-m", "unbroken", "coordinator", "--host", self.host, "--port", "0",
            "--etcd", ",".join(c.etcd), "--etcd-prefix", c.etcd_prefix, "--exit-with-parent",
            *c.coordinator_args,
        ]  # fmt: skip
        if c.gloo_host is None:
            cmd += ["--advertise", os.uname().nodename]
        tls = c.etcd_tls
        for flag, path in (("--etcd-cacert", tls and tls.cacert), ("--etcd-cert", tls and tls.cert),
                           ("--etcd-key", tls and tls.key)):  # fmt: skip
            if path:
                cmd += [flag, str(path)]
        return cmd

    def start(self) -> None:
        env = dict(os.environ)
        if self.config.token:
            env[ENV_TOKEN] = self.config.token  # not on the command line, where `ps` shows it
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
        log.info("coordinator candidate started (pid %d)", self.proc.pid)

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # resigns: the lease is revoked, another candidate leads now
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
