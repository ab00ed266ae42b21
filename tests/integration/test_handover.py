"""What a new leader inherits through etcd: the newest epoch's number and the audits' verdicts
(a corrupted replica's contributions are refused whoever leads), with a real etcd cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path

from unbroken.config import ServiceConfig
from unbroken.control import messages as m
from unbroken.control.membership import Decision
from unbroken.control.office import Office
from unbroken.testing.etcd import EtcdCluster


def test_a_new_leader_inherits_the_epoch_number_and_the_audits_verdicts(tmp_path: Path) -> None:
    verdicts = [m.Refusal(epoch=3, step=40), m.Refusal(epoch=5, step=90)]
    order = m.EpochOrder(
        epoch=6, term=0, members=["a", "b"], shares=[4, 4], urgent=True, reason="audit", refused=verdicts
    )

    async def run(endpoints: list[str]) -> tuple[int, int, list[m.Refusal]]:
        config = ServiceConfig(etcd=tuple(endpoints), etcd_prefix="/unbroken/handover")
        elected: dict[str, asyncio.Future[tuple[int, int, list[m.Refusal]]]] = {}

        def office(name: str, port: int) -> Office:
            loop = asyncio.get_running_loop()
            elected[name] = loop.create_future()
            return Office(
                config, name, lambda: ("127.0.0.1", port), job=lambda: "job", step=lambda: 90,
                on_elected=lambda term, floor, refused: elected[name].set_result((term, floor, refused)),
                on_deposed=lambda why: None, deliver=lambda d: None,
            )  # fmt: skip

        first = office("first", 1)
        await first.start()
        await asyncio.wait_for(elected["first"], 10)
        first.submit(Decision(orders={"a": order, "b": order}))
        await asyncio.sleep(0.5)  # published in etcd before it is delivered
        second = office("second", 2)
        await second.start()
        await first.close()  # resigns: the standby leads at once
        try:
            return await asyncio.wait_for(elected["second"], 10)
        finally:
            await second.close()

    with EtcdCluster(tmp_path / "etcd") as etcd:
        first_term, floor, refused = asyncio.run(run(etcd.endpoints))
    assert first_term > 0
    assert floor == 6, "the new leader numbers its epochs above the newest published"
    assert refused == verdicts, "the audits' verdicts outlive the leader that ordered them"
