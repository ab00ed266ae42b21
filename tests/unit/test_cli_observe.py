"""`unbroken status` renders the API's answers; `unbroken events` lines carry every field."""

from __future__ import annotations

from rich.console import Console

from unbroken.cli.observe import event_line, status_view
from unbroken.events import Kind, Recorded
from unbroken.sched.nat import unreachable

STATE = {
    "job": "lm",
    "step": 120,
    "epoch": 4,
    "finished": False,
    "recovering": False,
    "plan": {"mode": "diloco"},
    "members": [
        {"name": "gpu0", "state": "active", "role": "trainer", "zone": "paris", "share": 48, "rank": 0,
         "compute_s": [0.2], "step": 120,
         "capabilities": {"device": "cuda", "device_name": "H200", "memory_used": 2**31, "memory_total": 2**33}},
        {"name": "cpu1", "state": "active", "role": "standby", "zone": "lyon", "share": 0, "rank": 1,
         "compute_s": None, "step": 120, "capabilities": {"device": "cpu"}},
    ],
}  # fmt: skip
HISTORY = {"points": [{"step": 120, "loss": 0.75, "samples_per_s": 240.0}], "step_rate": 2.5}
EVENTS = [
    Recorded(1, 0.0, Kind.JOIN, "cpu1", "cpu1#a", 3, 100, "cpu1 connected"),
    Recorded(2, 1.0, Kind.FLAPPING, "gpu0", "gpu0#b", 4, 110, "gpu0 failed 3 times in 40 s"),
]


def render() -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(status_view(STATE, HISTORY, EVENTS))
    return console.export_text()


def test_status_shows_the_job_the_members_and_the_events() -> None:
    text = render()
    for needle in ("job lm", "step 120", "epoch 4", "mode diloco", "loss 0.7500", "steps/s 2.50", "samples/s 240"):
        assert needle in text, needle
    gpu = next(line for line in text.splitlines() if "gpu0" in line and "trainer" in line)
    assert "paris" in gpu and "48" in gpu and "240" in gpu and "H200" in gpu and "2.0/8.0 GiB" in gpu
    assert "standby" in text and "lyon" in text
    assert "flapping" in text and "failed 3 times" in text


def test_status_shows_how_to_let_peers_reach_a_member_benched_as_unreachable() -> None:
    verdict = unreachable("n3", ["n1", "n2"], [], behind=False)
    reason = f"n3 (offence 1): {verdict.reason}. " + "its data-plane address refuses or drops connections " * 5
    events = [Recorded(3, 2.0, Kind.UNREACHABLE, "n3", "n3#c", 5, 120, reason)]
    console = Console(width=200, record=True, color_system=None)
    console.print(status_view(STATE, HISTORY, events))
    text = " ".join(console.export_text().split())
    assert "--offer-forwarding PORT on a reachable member, or open its gloo port" in text


def test_an_event_line_has_time_kind_node_epoch_step_and_reason() -> None:
    line = event_line(EVENTS[1])
    assert "flapping" in line and "gpu0" in line and "epoch 4 step 110" in line and line.endswith("in 40 s")


def test_status_shows_who_leads_in_which_term_and_the_standbys() -> None:
    lead = {"role": "leader", "term": 7, "leader": "c1:29400", "standbys": ["c2:29400", "c3:29400"]}
    console = Console(width=200, record=True, color_system=None)
    console.print(status_view({**STATE, "leadership": lead}, HISTORY, EVENTS))
    text = console.export_text()
    assert "leader c1:29400 term 7" in text and "standbys c2:29400, c3:29400" in text
    assert "leader" not in render().splitlines()[0]  # a single coordinator: nothing to say


def test_status_follows_a_standby_to_the_leader(monkeypatch) -> None:
    from unbroken.cli import observe

    answers = {
        "http://c2:1/api/state": {"leadership": {"role": "standby", "leader": "c1:1"}, "members": []},
        "http://c1:1/api/state": {"leadership": {"role": "leader", "leader": "c1:1"}, "members": [{"name": "n"}]},
    }
    api = observe.Api("c2:1")
    monkeypatch.setattr(api, "_get", lambda path: answers[api.base + path])
    assert api.get("/api/state")["members"] == [{"name": "n"}]
    assert api.base == "http://c1:1"


HOSTILE = "ev\x1b]0;owned\x07il\x1b[2J[/]x"
"""A member name with a terminal title change, a screen clear and a closing tag of rich
markup that opens nothing (rich raised on it: `unbroken status` crashed)."""


def test_status_shows_what_nodes_chose_escaped_never_obeyed() -> None:
    import io

    out = io.StringIO()
    state = {**STATE, "job": "j\x1b[31m", "members": [{**STATE["members"][0], "name": HOSTILE,
             "capabilities": {"device": "cpu", "device_name": "gpu\x9b2J"}}]}  # fmt: skip
    events = [Recorded(1, 0.0, Kind.LEAVE, HOSTILE, "x#1", 3, 100, f"{HOSTILE} leaves: bye\x1b[A\rforged line")]
    Console(file=out, width=400, color_system=None).print(status_view(state, HISTORY, events))
    text = out.getvalue()
    assert not any(c in text for c in "\x1b\x07\x9b\r"), repr(text)
    assert "ev\\x1b]0;owned\\x07il\\x1b[2J[/]x" in text  # the name, escaped and whole
    assert "j\\x1b[31m" in text and "gpu\\x9b2J" in text and "bye\\x1b[A\\rforged line" in text


def test_an_event_line_escapes_the_nodes_name_and_reason() -> None:
    line = event_line(Recorded(1, 0.0, Kind.LEAVE, HOSTILE, "x#1", 3, 100, "bye\x1b[A\nforged line"))
    assert line.isprintable(), repr(line)
    assert "ev\\x1b]0;owned" in line and line.endswith("bye\\x1b[A\\nforged line")
