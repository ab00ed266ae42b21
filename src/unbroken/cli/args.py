"""Options several commands share: etcd, the token, a forwarding offer."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from unbroken.config import DEFAULT_ETCD_PREFIX, ENV_ETCD, EtcdTLS, parse_address, parse_endpoints
from unbroken.control.auth import ENV_TOKEN
from unbroken.errors import ConfigError


def etcd_endpoints(args: argparse.Namespace) -> tuple[str, ...]:
    return parse_endpoints(",".join(args.etcd or []) or os.environ.get(ENV_ETCD, ""))


def etcd_tls(args: argparse.Namespace) -> EtcdTLS | None:
    files = (args.etcd_cacert, args.etcd_cert, args.etcd_key)
    if not any(files):
        return None
    cacert, cert, key = (Path(f) if f else None for f in files)
    return EtcdTLS(cacert=cacert, cert=cert, key=key)


def etcd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--etcd",
        action="append",
        help=f"etcd client URLs, comma-separated (repeatable; default ${ENV_ETCD}): the job's leader is elected there",
    )
    p.add_argument("--etcd-prefix", default=DEFAULT_ETCD_PREFIX, help="the job's place in etcd (one per job)")
    p.add_argument("--etcd-cacert", metavar="FILE", help="the CA of the etcd members' certificates (https:// etcd)")
    p.add_argument(
        "--etcd-cert", metavar="FILE", help="this client's certificate (PEM), for an etcd with --client-cert-auth"
    )
    p.add_argument("--etcd-key", metavar="FILE", help="the private key of --etcd-cert (PEM)")


def token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", help=f"the job's secret (visible in `ps`: prefer --token-file or ${ENV_TOKEN})")
    p.add_argument("--token-file", help="read the job's secret from this file")


def offer_forwarding(value: str | None, gloo_host: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    if ":" in value:
        return parse_address(value)
    if not value.isdigit():
        raise ConfigError(f"--offer-forwarding {value!r} is not [HOST:]PORT: give e.g. 7800 or 10.0.0.5:7800")
    return (gloo_host or "0.0.0.0", int(value))
