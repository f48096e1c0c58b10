"""The vLLM update session: every legal path, illegal transitions refused; no engine.

The session only says which steps to carry out; these tests carry them out as
:class:`~asyncrefit.vllm._link._EngineLink` does (``asking`` before each step, ``done``
after it, ``failed`` for a cleanup step that failed) and check the steps and the state.
A stateful property test drives it through random pushes, failures and aborts against a
model of the engine, and checks that generation never resumes inside vLLM's update, nor
on KV of older weights under a label that does not say so, nor under a label that
claims a version the engine does not hold whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from asyncrefit import AsyncRefitError, SessionError
from asyncrefit.vllm._session import (
    AbortWorkers,
    EngineStep,
    Finish,
    Pause,
    Phase,
    Relabel,
    ResetCache,
    Resume,
    Session,
    Start,
)


def carry_out(
    session: Session, steps: Iterable[EngineStep], fails: Iterable[type] = ()
) -> list[str]:
    """Cleanup steps as the link carries them out; steps of a type in ``fails`` fail."""
    failing = tuple(fails)
    pending, log = list(steps), []
    while pending:
        step = pending.pop(0)
        session.asking(step)
        if isinstance(step, failing):
            log.append(f"{step!r} failed")
            pending[:0] = session.failed(step)
        else:
            log.append(repr(step))
            session.done(step)
        session.check()
    return log


def push_steps(session: Session, steps: Iterable[EngineStep]) -> None:
    for step in steps:
        session.asking(step)
        session.done(step)
        session.check()


def begun(version: int = 1) -> Session:
    session = Session()
    push_steps(session, session.begin(version))
    return session


def abort(session: Session, *, confirmed: bool = True, written: bool = False) -> list[str]:
    """The link's abort: the workers, vLLM's update, then the resume."""
    log: list[str] = []
    for ask in session.abort():
        session.asking(ask)
        log.append(repr(ask))
        log += carry_out(session, session.aborted(confirmed=confirmed, written=written))
    return log + carry_out(session, session.resume())


# --- legal paths ---------------------------------------------------------------------


def test_a_push_pauses_starts_finishes_with_the_label_resets_and_resumes() -> None:
    session = Session()
    assert repr(session.phase) == "<Phase.IDLE: 'idle'>"
    assert not session.paused and not session.must_abort
    assert session.begin(3) == (Pause(), Start(3))
    session.asking(Pause())
    assert session.phase is Phase.PAUSED and session.paused
    session.done(Pause())
    session.asking(Start(3))
    assert session.phase is Phase.UPDATING and session.version == 3
    assert session.must_abort  # from the start being asked: it may have happened
    session.done(Start(3))
    assert session.receiving(3) and not session.receiving(2)
    steps = session.commit(3)
    assert steps == (Finish("3"), ResetCache(), Resume())
    session.asking(steps[0])
    assert session.phase is Phase.FINISHING and session.stale_cache
    session.done(steps[0])
    assert session.phase is Phase.PAUSED and session.version is None and session.stale_cache
    push_steps(session, steps[1:])
    assert session.phase is Phase.IDLE and not session.stale_cache and not session.must_abort
    assert session.abort() == () and session.resume() == ()
    session.check()


def test_pushes_follow_each_other() -> None:
    session = Session()
    for version in (1, 2, 3):
        push_steps(session, session.begin(version))
        push_steps(session, session.commit(version))
        assert session.phase is Phase.IDLE


def test_an_abort_before_any_byte_ends_the_update_and_keeps_the_cache() -> None:
    session = begun(1)
    assert abort(session) == [
        "AbortWorkers(version=1)",
        "Finish(label=None)",
        "Resume()",
    ]
    assert session.phase is Phase.IDLE and not session.stale_cache
    push_steps(session, session.begin(2))  # the next push may begin


def test_an_abort_after_bytes_were_written_relabels_and_resets_the_cache() -> None:
    session = begun(1)
    assert abort(session, written=True) == [
        "AbortWorkers(version=1)",
        "Finish(label=None)",
        "Relabel(label='incomplete-1')",
        "ResetCache()",
        "Resume()",
    ]
    assert session.phase is Phase.IDLE and not session.stale_cache


def test_an_unanswered_abort_counts_as_written_and_is_asked_again() -> None:
    session = begun(1)
    log = abort(session, confirmed=False)
    assert "Relabel(label='incomplete-1')" in log and log[-2:] == ["ResetCache()", "Resume()"]
    assert session.unconfirmed == 1 and session.must_abort and session.phase is Phase.IDLE
    with pytest.raises(SessionError):
        session.begin(2)  # no begin before the abort is confirmed
    assert abort(session, confirmed=False) == ["AbortWorkers(version=1)"]  # still unanswered
    assert session.unconfirmed == 1
    assert abort(session) == ["AbortWorkers(version=1)"]  # only confirming: no finish
    assert session.unconfirmed is None and not session.must_abort
    push_steps(session, session.begin(2))


def test_a_failed_finish_counts_every_byte_written() -> None:
    session = begun(1)
    finish, _, _ = session.commit(1)
    session.asking(finish)  # and vLLM's finish raises: the push fails, the step stays asked
    assert session.phase is Phase.FINISHING and session.must_abort
    assert abort(session, written=False) == [
        "AbortWorkers(version=1)",
        "Finish(label=None)",
        "Relabel(label='incomplete-1')",
        "ResetCache()",
        "Resume()",
    ]


def test_an_end_of_the_update_that_failed_still_ends_it() -> None:
    session = begun(1)
    log = []
    for ask in session.abort():
        session.asking(ask)
        log += carry_out(session, session.aborted(confirmed=True, written=False), fails=[Finish])
    assert log == ["Finish(label=None) failed"]
    assert session.phase is Phase.PAUSED and not session.must_abort
    assert carry_out(session, session.resume()) == ["Resume()"]


def test_a_reset_that_fails_relabels_the_engine_stale_cache_and_still_resumes() -> None:
    session = begun(1)
    finish, reset, _ = session.commit(1)
    push_steps(session, [finish])
    session.asking(reset)  # fails: the commit fails, still paused
    assert session.stale_cache and session.paused
    assert carry_out(session, session.resume(), fails=[ResetCache]) == [
        "ResetCache() failed",
        "Relabel(label='stale-cache')",
        "Resume()",
    ]
    assert session.phase is Phase.IDLE and session.stale_cache
    # The next abort (or the close) tries the reset again, and resumes again.
    assert abort(session) == ["ResetCache()", "Resume()"]
    assert not session.stale_cache


def test_a_resume_that_fails_is_owed_until_one_succeeds() -> None:
    session = begun(1)
    _, reset, resume = session.commit(1)
    push_steps(session, [Finish("1"), reset])
    session.asking(resume)  # fails: the commit fails, its weights are in
    assert session.phase is Phase.PAUSED and not session.must_abort
    assert abort(session) == ["Resume()"]  # no relabel: the weights were committed
    session2 = begun(1)  # an abort whose resume fails
    for ask in session2.abort():
        session2.asking(ask)
        carry_out(session2, session2.aborted(confirmed=True, written=False))
    assert carry_out(session2, session2.resume(), fails=[Resume]) == ["Resume() failed"]
    assert session2.phase is Phase.PAUSED
    assert carry_out(session2, session2.resume()) == ["Resume()"]


def test_a_pause_that_failed_starts_nothing_and_is_resumed() -> None:
    session = Session()
    pause, _ = session.begin(1)
    session.asking(pause)  # fails or is cancelled: the begin fails
    assert session.paused and not session.must_abort
    assert abort(session) == ["Resume()"]


def test_a_start_that_was_cancelled_is_ended_by_the_abort() -> None:
    session = Session()
    pause, start = session.begin(1)
    push_steps(session, [pause])
    session.asking(start)  # cancelled: vLLM may still start the update
    assert abort(session) == ["AbortWorkers(version=1)", "Finish(label=None)", "Resume()"]


def test_a_paused_engine_may_begin_again() -> None:
    session = Session()
    session.asking(Pause())
    assert session.begin(1) == (Pause(), Start(1))
    push_steps(session, session.begin(1))
    assert session.receiving(1)


# --- illegal transitions -------------------------------------------------------------


def updating() -> Session:
    return begun(1)


def finishing() -> Session:
    session = begun(1)
    session.asking(Finish("1"))
    return session


def aborting() -> Session:
    session = begun(1)
    session.asking(AbortWorkers(1))
    session.aborted(confirmed=True, written=False)
    return session


def unconfirmed() -> Session:
    session = begun(1)
    abort(session, confirmed=False)
    return session


REFUSED: list[tuple[str, Callable[[], Session], Callable[[Session], object]]] = [
    ("begin while updating", updating, lambda s: s.begin(2)),
    ("begin while finishing", finishing, lambda s: s.begin(2)),
    ("begin while aborting", aborting, lambda s: s.begin(2)),
    ("begin before an abort is confirmed", unconfirmed, lambda s: s.begin(2)),
    ("commit when idle", Session, lambda s: s.commit(1)),
    ("commit of another version", updating, lambda s: s.commit(2)),
    ("commit twice", finishing, lambda s: s.commit(1)),
    ("start without a pause", Session, lambda s: s.asking(Start(1))),
    ("start twice", updating, lambda s: s.asking(Start(2))),
    ("pause inside an update", updating, lambda s: s.asking(Pause())),
    ("resume inside an update", updating, lambda s: s.asking(Resume())),
    ("resume while finishing", finishing, lambda s: s.asking(Resume())),
    ("resume while aborting", aborting, lambda s: s.asking(Resume())),
    ("reset inside an update", updating, lambda s: s.asking(ResetCache())),
    ("relabel inside an update", updating, lambda s: s.asking(Relabel("x"))),
    ("finish with another label", updating, lambda s: s.asking(Finish("2"))),
    ("finish without an update", Session, lambda s: s.asking(Finish("1"))),
    ("the abort's finish without an abort", updating, lambda s: s.asking(Finish(None))),
    ("abort of another version", updating, lambda s: s.asking(AbortWorkers(2))),
    ("abort with nothing to abort", Session, lambda s: s.asking(AbortWorkers(1))),
    ("aborted without asking", updating, lambda s: s.aborted(confirmed=True, written=False)),
    ("done with nothing asked", Session, lambda s: s.done(Resume())),
    ("done for another step", finishing, lambda s: s.done(Finish(None))),
    ("done for the abort", aborting, lambda s: s.done(AbortWorkers(1))),
    ("failed for the abort", aborting, lambda s: s.failed(AbortWorkers(1))),
]


@pytest.mark.parametrize(("make", "act"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_illegal_transitions_are_refused_and_change_nothing(
    make: Callable[[], Session], act: Callable[[Session], object]
) -> None:
    session = make()
    before = repr(session), session._asked
    with pytest.raises(SessionError) as info:
        act(session)
    assert isinstance(info.value, AsyncRefitError)
    assert "is not allowed in <vLLM session" in str(info.value)
    assert (repr(session), session._asked) == before
    session.check()


def test_the_phases_and_fields_stay_a_legal_combination() -> None:
    session = Session()
    session._phase = Phase.UPDATING  # a version is missing
    with pytest.raises(SessionError, match="illegal state"):
        session.check()


# --- random pushes against a model of the engine -------------------------------------

OUTCOMES = st.sampled_from(["ok"] * 6 + ["failed", "failed-after-running"])


class Engine:
    """What vLLM does with the steps; a failed step may have run or not."""

    def __init__(self) -> None:
        self.update_open = False
        self.paused = False
        self.label: str | None = None
        self.stale = False  # weights changed since the prefix cache was last cleared
        self.partial: int | None = None  # a version some bytes of which are in
        self.resumes = 0

    def run(self, step: EngineStep) -> bool:
        """Whether ``step`` succeeded (vLLM refuses to finish an update never started)."""
        match step:
            case Pause():
                self.paused, self.stale = True, False  # the pause clears the cache
            case Start():
                assert not self.update_open, "a weight update is already active"
                self.update_open = True
            case Finish(label=label):
                if not self.update_open:
                    return False
                self.update_open = False
                if label is not None:
                    self.label, self.partial = label, None
            case ResetCache():
                self.stale = False
            case Resume():
                assert not self.update_open, "generation resumed inside a weight update"
                if self.stale:
                    assert self.label == "stale-cache", "stale KV served under a version"
                if self.partial is not None:
                    assert self.label is None or not self.label.isdigit(), (
                        f"label {self.label} while version {self.partial} is partly in"
                    )
                self.paused = False
                self.resumes += 1
            case Relabel(label=label):
                self.label = label
        return True


class SessionMachine(RuleBasedStateMachine):
    """Random pushes, failures and aborts; the engine model checks what is served."""

    def __init__(self) -> None:
        super().__init__()
        self.session = Session()
        self.engine = Engine()
        self.version = 0
        self.written = False  # bytes of the open version reached a worker

    def _push(self, steps: Iterable[EngineStep], data: st.DataObject) -> bool:
        """Steps of a push: the first that fails fails the push (it stays asked)."""
        for step in steps:
            self.session.asking(step)
            outcome = data.draw(OUTCOMES)
            ran = outcome != "failed" and self.engine.run(step)
            if outcome != "ok" or not ran:
                return False
            self.session.done(step)
        return True

    def _clean_up(self, steps: Iterable[EngineStep], data: st.DataObject) -> None:
        pending = list(steps)
        while pending:
            step = pending.pop(0)
            self.session.asking(step)
            outcome = data.draw(OUTCOMES)
            # A call that timed out still runs (the engine runs its calls in order, to
            # their end); vLLM's finish and the label do not fail otherwise.
            ran = True
            if outcome != "failed" or isinstance(step, Finish | Relabel):
                ran = self.engine.run(step)
            if outcome == "ok" and ran:
                self.session.done(step)
            else:
                pending[:0] = self.session.failed(step)

    def _abort(self, data: st.DataObject) -> None:
        for ask in self.session.abort():
            self.session.asking(ask)
            confirmed = data.draw(st.booleans())
            steps = self.session.aborted(confirmed=confirmed, written=self.written)
            if self.session.phase is Phase.ABORTING:
                self.written = False
            self._clean_up(steps, data)
        self._clean_up(self.session.resume(), data)

    @rule(data=st.data())
    def begin(self, data: st.DataObject) -> None:
        if self.session.must_abort:
            self._abort(data)
            if self.session.must_abort:
                with pytest.raises(SessionError):
                    self.session.begin(self.version + 1)
                return
        self.version += 1
        self._push(self.session.begin(self.version), data)

    @rule()
    def load(self) -> None:
        # update_weights fails outside vLLM's update (a start that failed)
        if self.session.receiving(self.version) and self.engine.update_open:
            self.written = True
            self.engine.partial = self.version
            self.engine.stale = True

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        if not self.session.receiving(self.version):
            with pytest.raises(SessionError):
                self.session.commit(self.version)
            return
        if not self.engine.update_open:
            return  # the commit's update_weights fails: the push fails
        if self._push(self.session.commit(self.version), data):
            assert self.engine.label == str(self.version) and not self.engine.paused
            self.written = False

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._abort(data)
        if not self.session.must_abort and self.session.phase is Phase.IDLE:
            assert not self.engine.update_open

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        """Aborts until every step succeeds: the engine ends idle, on a fresh cache."""
        self._abort(data)
        for ask in self.session.abort():
            self.session.asking(ask)
            carry = self.session.aborted(confirmed=True, written=self.written)
            for step in carry:
                self.session.asking(step)
                if self.engine.run(step):
                    self.session.done(step)
                else:
                    assert not self.session.failed(step)
        for step in self.session.resume():
            self.session.asking(step)
            self.engine.run(step)
            self.session.done(step)
        self.written = False
        assert self.session.phase is Phase.IDLE and not self.session.stale_cache
        assert not self.session.must_abort
        assert not self.engine.update_open and not self.engine.paused and not self.engine.stale

    @invariant()
    def legal(self) -> None:
        self.session.check()

    @invariant()
    def an_open_update_is_owed_an_abort(self) -> None:
        if self.engine.update_open:
            assert self.session.must_abort
        if self.engine.paused:
            assert self.session.paused


SessionMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_session_state_machine = SessionMachine.TestCase
