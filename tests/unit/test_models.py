"""Job spec validation: torchrun's syntaxes accepted, bad specs refused with the field named."""

import pytest
from pydantic import ValidationError

from elasticd.models import JobSpec, std_for_rank


def test_defaults_follow_torchrun():
    """max_restarts defaults to 3, max_nodes to min_nodes, one worker per node."""
    spec = JobSpec(entrypoint="python")
    assert (spec.max_restarts, spec.nproc_per_node, spec.min_nodes, spec.max_nodes) == (3, 1, 1, 1)


@pytest.mark.parametrize(
    ("value", "canonical"),
    [(3, "all"), ("1", "out"), ("err", "err"), ("0:3,1:2", "0:all,1:err"), ({"1": "out"}, "1:out")],
)
def test_redirects_and_tee_take_torchrun_syntax(value, canonical):
    """--redirects/--tee accept 0-3, names, and per-rank maps."""
    spec = JobSpec(entrypoint="python", redirects=value, tee=value)
    assert spec.redirects == canonical
    assert spec.tee == canonical


def test_std_for_rank_reads_per_rank_maps():
    """A per-rank map applies to the named ranks only."""
    assert std_for_rank("0:all,1:err", 1) == "err"
    assert std_for_rank("0:all,1:err", 2) == "none"
    assert std_for_rank("out", 7) == "out"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"entrypoint": ""}, "entrypoint"),
        ({"entrypoint": "   "}, "entrypoint"),
        ({"entrypoint": "x", "nproc_per_node": -1}, "nproc_per_node"),
        ({"entrypoint": "x", "max_restarts": -1}, "max_restarts"),
        ({"entrypoint": "x", "min_nodes": 3, "max_nodes": 2}, "min_nodes"),
        ({"entrypoint": "x", "env": {"A": 1}}, "env"),
        ({"entrypoint": "x", "bogus": 1}, "bogus"),
        ({"entrypoint": "x", "termination_grace": -1}, "termination_grace"),
        ({"entrypoint": "x", "redirects": "7"}, "redirects"),
        ({"entrypoint": "x", "id": "../etc"}, "id"),
        ({"entrypoint": "x", "master_port": 70000}, "master_port"),
        ({"entrypoint": "x", "umask": "8"}, "umask"),
        ({"entrypoint": "x", "umask": "0o1000"}, "umask"),
        ({"entrypoint": "x", "umask": 0o1000}, "umask"),
        ({"entrypoint": "x", "umask": -1}, "umask"),
        ({"entrypoint": "x", "umask": True}, "umask"),
        ({"entrypoint": "x", "umask": ""}, "umask"),
        ({"entrypoint": "x", "umask": 7.0}, "umask"),
        ({"entrypoint": "x", "progress_timeout": "fast"}, "progress_timeout"),
        ({"entrypoint": "x", "progress_timeout": 0}, "progress_timeout"),
        ({"entrypoint": "x", "progress_timeout": 90_000}, "progress_timeout"),
        ({"entrypoint": "x", "progress_timeout": True}, "progress_timeout"),
        ({"entrypoint": "x", "checkpoint_timeout": 0}, "checkpoint_timeout"),
        ({"entrypoint": "x", "max_no_progress_restarts": 0}, "max_no_progress_restarts"),
    ],
)
def test_bad_specs_name_the_field(body, field):
    """Each malformed spec fails validation with a message that names the field."""
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    assert field in str(info.value)


def test_idempotency_compares_specs_without_id():
    """Two submissions that differ only by id compare equal for idempotency."""
    a = JobSpec(id="a", entrypoint="python", args=["t.py"])
    b = JobSpec(id="b", entrypoint="python", args=["t.py"])
    assert a.without_id() == b.without_id()


@pytest.mark.parametrize(
    ("fields", "rank", "expected"),
    [
        ({}, 0, (True, True)),
        ({"redirects": "all"}, 0, (False, False)),
        ({"redirects": "all", "tee": "err"}, 0, (False, True)),
        ({"redirects": "0:out"}, 1, (True, True)),
        ({"redirects": "0:out"}, 0, (False, True)),
        ({"local_ranks_filter": [1]}, 0, (False, False)),
        ({"local_ranks_filter": "1", "tee": "all"}, 1, (True, True)),
    ],
)
def test_console_streams_follow_torchrun(fields, rank, expected):
    """redirects hide a stream from the console, tee shows it again, the filter picks ranks."""
    from elasticd.models import console_streams

    assert console_streams(JobSpec(entrypoint="x", **fields), rank) == expected


def test_run_status_line_redraws_on_a_tty_and_throttles_otherwise():
    """`elasticd run`'s status line overwrites itself on a terminal, prints sparingly in logs."""
    import io

    from elasticd.cli import StatusLine

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    line = StatusLine(tty)
    line.show("[elasticd] rendezvous pending: 1s")
    line.show("[elasticd] rendezvous pending: 2s")
    line.clear()
    assert tty.getvalue().count("\r\033[K") == 3 and "pending: 2s" in tty.getvalue()
    log = io.StringIO()
    line = StatusLine(log)
    for i in range(5):
        line.show(f"pending {i}")
    assert log.getvalue() == "pending 0\n"


@pytest.mark.parametrize(
    ("given", "kept", "bits"),
    [
        (None, None, 0o027),
        ("077", "0077", 0o077),
        ("0027", "0027", 0o027),
        ("0o22", "0022", 0o022),
        ("7", "0007", 0o007),
        (0o077, "0077", 0o077),
        (0, "0000", 0),
        (0o777, "0777", 0o777),
    ],
)
def test_a_umask_is_octal_text_or_an_int_kept_as_four_digits(given, kept, bits):
    """`umask` takes "077" or an int, keeps four octal digits; no umask means 0027."""
    spec = JobSpec(entrypoint="x", umask=given)
    assert (spec.umask, spec.umask_bits) == (kept, bits)


def test_progress_rules_of_a_spec():
    """progress_timeout is seconds or "auto"; the no-progress rule and checkpoint_timeout are
    off by default."""
    spec = JobSpec(entrypoint="x")
    assert spec.progress_timeout is None and spec.checkpoint_timeout is None
    assert spec.max_no_progress_restarts is None
    assert (
        JobSpec.model_validate({"entrypoint": "x", "progress_timeout": "auto"}).progress_timeout
        == "auto"
    )
    assert (
        JobSpec.model_validate({"entrypoint": "x", "progress_timeout": 5}).progress_timeout == 5.0
    )
    with pytest.raises(ValidationError, match='a number of seconds or "auto"'):
        JobSpec.model_validate({"entrypoint": "x", "progress_timeout": "fast"})


def test_recovery_phases_say_when_they_overlap():
    """Phases that add up to the total read as they are; a round that formed while the old
    workers stopped makes them add up to more, and the text says they overlap."""
    from elasticd.models import Recovery

    apart = Recovery(
        round=1, cause="c", detected_at=0, stop_s=0.2, rendezvous_s=0.5, spawn_s=0.05, total_s=0.75
    )
    assert apart.phases_text() == "stop 0.200s, rendezvous 0.500s, spawn 0.050s"
    formed_while_stopping = apart.model_copy(
        update={"rendezvous_s": 0.0, "spawn_s": 0.6, "total_s": 0.6}
    )
    assert formed_while_stopping.phases_text() == (
        "stop 0.200s, rendezvous 0.000s, spawn 0.600s (the phases overlap: they add up to "
        "0.800s, more than the 0.600s total)"
    )


def test_a_root_cause_names_only_what_is_known():
    """A worker's failure names its rank and place; a health check's (no rank) its node;
    nothing unknown is shown as None."""
    from elasticd.models import RootCause

    worker = RootCause(message="m", rank=1, node="a", local_rank=1, attempt=0)
    assert worker.who() == "rank 1 (node a, local rank 1, attempt 0)"
    assert worker.who(attempt=False) == "rank 1 (node a, local rank 1)"
    assert RootCause(message="m", node="a", attempt=2).who() == "node a (attempt 2)"
    assert RootCause(message="m").who() == "a worker"
