"""The retention sensor's decision (`sparkpoint.sensors.retention.retention_decision`), a pure
function of the checkpoints it has not looked at: a prune when a checkpoint said one is due or the
orphan sweep's grace period passed since its job's last prune, at most one per job, none otherwise."""

from __future__ import annotations

from sparkpoint.sensors.retention import CheckpointSeen, Prune, RetentionCursor, retention_decision

A = {"sparkpoint_storage": {"config": {"job_id": "a"}}}
B = {"sparkpoint_storage": {"config": {"job_id": "b"}}}
GRACE = 3600.0


def _job(config: dict) -> str:
    return CheckpointSeen(0, config).job


def test_a_checkpoint_that_says_a_prune_is_due_gets_one_with_its_runs_config_and_why():
    prunes, pruned = retention_decision([CheckpointSeen(7, A, ("chk-3 beyond num_retained",))], {_job(A): 1000.0},
                                        now=1001.0, orphan_grace_seconds=GRACE)
    assert prunes == [Prune("prune-after-7", A, "chk-3 beyond num_retained")]
    assert pruned == {_job(A): 1001.0}


def test_nothing_due_and_a_recent_prune_means_no_run_after_the_checkpoint():
    prunes, pruned = retention_decision([CheckpointSeen(7, A)], {_job(A): 1000.0}, now=1000.0 + GRACE - 1,
                                        orphan_grace_seconds=GRACE)
    assert prunes == [] and pruned == {_job(A): 1000.0}


def test_the_orphan_sweep_is_due_once_the_grace_period_passed_since_the_jobs_last_prune():
    never, _ = retention_decision([CheckpointSeen(7, A)], {}, now=GRACE, orphan_grace_seconds=GRACE)
    later, _ = retention_decision([CheckpointSeen(8, A)], {_job(A): 10.0}, now=10.0 + GRACE,
                                  orphan_grace_seconds=GRACE)
    assert never == [Prune("prune-after-7", A, "orphan sweep due")]
    assert later == [Prune("prune-after-8", A, "orphan sweep due")]


def test_one_prune_per_job_named_after_its_newest_due_checkpoint_and_each_job_on_its_own():
    new = [CheckpointSeen(9, A, ("due",)), CheckpointSeen(8, B), CheckpointSeen(7, A, ("due earlier",))]
    prunes, pruned = retention_decision(new, {_job(B): 100.0}, now=200.0, orphan_grace_seconds=GRACE)
    assert prunes == [Prune("prune-after-9", A, "due")]
    assert pruned == {_job(A): 200.0, _job(B): 100.0}


def test_an_older_checkpoint_of_a_job_still_counts_when_its_newest_says_nothing_is_due():
    new = [CheckpointSeen(9, A), CheckpointSeen(7, A, ("chk-2 beyond num_retained",))]
    prunes, _ = retention_decision(new, {_job(A): 100.0}, now=200.0, orphan_grace_seconds=GRACE)
    assert prunes == [Prune("prune-after-7", A, "chk-2 beyond num_retained")]


def test_the_cursor_reads_what_it_wrote_and_an_earlier_versions_bare_storage_id():
    cursor = RetentionCursor(42, {_job(A): 5.0})
    assert RetentionCursor.from_cursor(cursor.to_cursor()) == cursor
    assert RetentionCursor.from_cursor("17") == RetentionCursor(17)
    assert RetentionCursor.from_cursor(None) == RetentionCursor()


def test_a_checkpoint_run_that_pruned_is_the_jobs_last_prune_for_the_checkpoints_after_it():
    """Seen in one tick: chk-1, whose run swept (the job's first prune), then chk-2 and chk-3 whose
    runs did not (the sweep was recent); only what a checkpoint says is due asks for a prune run."""
    ordinary = [CheckpointSeen(9, A), CheckpointSeen(8, A), CheckpointSeen(7, A, pruned_in_run=True)]
    prunes, pruned = retention_decision(ordinary, {}, now=GRACE * 5, orphan_grace_seconds=GRACE)
    assert prunes == [] and pruned == {_job(A): GRACE * 5}, "never pruned by a run, but by chk-7's"
    due = [CheckpointSeen(9, A, ("1 attempt(s) at or below chk-9 can never complete",)),
           CheckpointSeen(7, A, pruned_in_run=True), CheckpointSeen(6, B)]
    prunes, _ = retention_decision(due, {_job(B): GRACE * 5 - 10}, now=GRACE * 5, orphan_grace_seconds=GRACE)
    assert [(p.run_key, p.because) for p in prunes] == [
        ("prune-after-9", "1 attempt(s) at or below chk-9 can never complete")], "what chk-9 says; B's sweep is recent"
    newest_pruned = [CheckpointSeen(9, A, pruned_in_run=True), CheckpointSeen(8, A, ("due before chk-9's prune",))]
    assert retention_decision(newest_pruned, {}, now=GRACE, orphan_grace_seconds=GRACE)[0] == []
