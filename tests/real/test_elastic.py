"""Hard failures without training: which generation a process joins (real/elastic.py), which deaths the launcher survives (real/launch.py)."""

from __future__ import annotations

import pytest


def test_a_replacement_skips_a_generation_abandoned_before_it_came(tmp_path, monkeypatch):
    # Stage 1 died in generation 0, and its replacement started while stage 0's was still pending,
    # so generation 0 is still the newest announced. Every member's mark is there and its outcome
    # says "formed"; joining it would wait on a group that is gone (seen as a 90 s rendezvous
    # timeout on a fast machine, 2026-11-27). The replacement must wait for a newer generation.
    from churnsim.real import elastic
    from churnsim.real.distributed import connect_store, serve_store
    from churnsim.real.run_secret import new_token, sign

    directory, token = str(tmp_path), new_token()
    server = serve_store("127.0.0.1", 5.0)
    store = connect_store("127.0.0.1", server.port, token, 5.0)
    elastic.announce(directory, 0, members=[0, 1], full=True, deaths=[])
    for stage in (0, 1):
        key = elastic.arrival_key(0, stage)
        store.set(key, sign(token, key, b"0"))
    store.compare_set("generation-0/outcome", "", sign(token, "generation-0/outcome", b"formed").decode())
    elastic.abandon(directory, 0)
    formed = []
    monkeypatch.setattr(elastic, "init_process_group", lambda **group: formed.append(group))
    settings = elastic.ElasticSettings(
        directory=directory, store_port=server.port, stage=1, num_stages=2, incarnation=1,
        rendezvous_timeout_s=0.3, run_started_unix_ns=0, token=token,
    )  # fmt: skip
    membership = elastic.Membership(settings, device="cpu", timeout_s=5.0)
    with pytest.raises(elastic.RendezvousFailed, match="no new generation was announced"):
        membership.join()
    assert formed == []


def _supervisor(directory, world_size: int):
    """The launcher's bookkeeping of a started run, without processes (only what `_exited` reads)."""
    from churnsim.real.elastic import STARTED_FILE, announce
    from churnsim.real.launch import HardFailureOptions, _Supervisor

    supervisor = object.__new__(_Supervisor)
    supervisor.directory, supervisor.world_size = str(directory), world_size
    supervisor.options = HardFailureOptions(join_delay_s=0.0)
    supervisor.processes, supervisor.incarnations = {}, {stage: 0 for stage in range(world_size)}
    supervisor.finished, supervisor.deaths, supervisor.pending = set(), [], {}
    supervisor.generation, supervisor.abandoned_through = 0, -1
    announce(str(directory), 0, members=list(range(world_size)), full=True, deaths=[])
    open(directory / STARTED_FILE, "wb").close()
    return supervisor


class _Killed:
    exitcode = -9
    pid = 4321


def test_a_death_after_a_peer_finished_ends_the_run_at_once(tmp_path):
    # The others would wait for the dead stage's result, not at the rendezvous: a replacement's
    # generation would never form, and the run would end only after the rendezvous timeout.
    from churnsim.real.elastic import result_path
    from churnsim.real.launch import RunAborted

    supervisor = _supervisor(tmp_path, 3)
    open(result_path(str(tmp_path), 0), "wb").close()
    with pytest.raises(RunAborted, match=r"stage/rank 2 ended with signal SIGKILL; stage\(s\) \[0\] had already finished"):
        supervisor._exited(2, _Killed())


def test_a_death_after_every_result_was_written_ends_nothing(tmp_path):
    from churnsim.real.elastic import result_path

    supervisor = _supervisor(tmp_path, 2)
    for stage in range(2):
        open(result_path(str(tmp_path), stage), "wb").close()
    supervisor._exited(1, _Killed())
    assert supervisor.finished == {1} and supervisor.deaths == [] and supervisor.pending == {}


def test_progress_is_looked_for_at_a_positive_interval():
    from churnsim.calibration.errors import InputError
    from churnsim.real.launch import launch_local
    from churnsim.real.trainer import TrainingConfig

    with pytest.raises(InputError, match="progress_interval_s"):
        launch_local(object.__new__(TrainingConfig), progress_interval_s=0.0)
