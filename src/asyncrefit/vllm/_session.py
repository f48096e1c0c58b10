"""The vLLM engine's update session as a pure state machine: no I/O, no awaits.

Owns what the coordinator's side of one engine must remember between engine calls:
whether generation may be paused, whether vLLM's weight-update session is open (and
for which version), whether the prefix cache holds KV computed with older weights, and
which abort the workers have not confirmed. :class:`~asyncrefit.vllm._link._EngineLink`
asks a :class:`Session` what to do, carries the returned steps out in order with the
engine's ops, and reports each step back:

* ``asking(step)`` just before carrying it out. The state changes *before* the call:
  a call that fails or is cancelled may still have happened in the engine (its calls
  run in order, to their end), so whatever it may have started is ended by the abort
  that follows.
* ``done(step)`` once it succeeded; ``failed(step)`` once a *cleanup* step (one carried
  out bounded, its failure logged) failed: it returns the steps to carry out before the
  remaining ones. A step of a push that fails fails the push: it is reported neither
  done nor failed, and stays asked.

Phases (generation is paused in every phase but ``IDLE``; ``v`` is the version)::

    phase      event                        steps returned                     next phase
    ---------  ---------------------------  ---------------------------------  -----------
    closed     begin(v)  (none unconfirmed) Pause, Start(v)
    closed     asking Pause                                                    PAUSED
    PAUSED     asking Start(v)                                                 UPDATING(v)
    UPDATING   commit(v)                    Finish("v"), ResetCache, Resume
    UPDATING   asking Finish("v")           (the cache becomes stale)          FINISHING(v)
    FINISHING  done Finish("v")                                                PAUSED
    open       abort()                      AbortWorkers(v)
    open       aborted(confirmed, written)  Finish(None)[, Relabel(            ABORTING(v)
                                            "incomplete-v")]
    ABORTING   done/failed Finish(None)                                        PAUSED
    closed     abort()  (v unconfirmed)     AbortWorkers(v)
    closed     aborted(confirmed, _)        (v is forgotten once confirmed)
    closed     resume()                     [ResetCache,] Resume  (if PAUSED
                                            or the cache is stale)
    closed     asking/done ResetCache       (the cache is fresh once done)
    closed     failed ResetCache            Relabel("stale-cache")
    closed     asking Relabel(label)
    closed     done Resume                                                     IDLE
    closed     failed Resume                (still owed)                       PAUSED

"open" is ``UPDATING``, ``FINISHING`` or ``ABORTING`` (vLLM's update may be open);
"closed" is ``IDLE`` or ``PAUSED``. An abort ends an open update: it asks the workers to
abort (:class:`AbortWorkers`), then ends vLLM's update; the weights count as written
(the cache becomes stale and the engine is labelled ``"incomplete-v"``) when a worker
says so, when the abort got no answer, or when every byte was in (``FINISHING``). An
unanswered abort is remembered (``unconfirmed``) and asked again by the next abort;
no update begins before it is confirmed. The cache is reset before generation resumes
whenever weights changed since its last reset; a reset that fails relabels the engine
``"stale-cache"`` and generation resumes anyway. Generation never resumes while an
update is open (only an abort interrupted by something other than a cancellation, which
its shield stops, leaves one open: the next abort or the close ends it, then resumes).

Errors: any other transition raises :class:`SessionError` (a bug of the caller, not of
the engine); the state is then unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from .._exceptions import SessionError


class Phase(enum.Enum):
    """Where the engine's update session stands."""

    #: Generation runs; no update is open.
    IDLE = "idle"
    #: Generation is paused (or its pause asked for, or its resume failed); no update.
    PAUSED = "paused"
    #: vLLM's weight update is started (or asked for): buckets load.
    UPDATING = "updating"
    #: Every byte is in; vLLM's finish (which labels the engine) is asked for.
    FINISHING = "finishing"
    #: The workers were asked to abort; vLLM's update is being ended.
    ABORTING = "aborting"


_OPEN = (Phase.UPDATING, Phase.FINISHING, Phase.ABORTING)
_CLOSED = (Phase.IDLE, Phase.PAUSED)


@dataclass(frozen=True, slots=True)
class Pause:
    """Pause generation (``AsyncLLM``), clearing the prefix cache."""

    what: ClassVar[str] = "pausing generation"


@dataclass(frozen=True, slots=True)
class Start:
    """Start vLLM's weight update for ``version``."""

    version: int
    what: ClassVar[str] = "starting vLLM's weight update"


@dataclass(frozen=True, slots=True)
class AbortWorkers:
    """Ask every worker to abort ``version`` (on the link's channels); the answer is
    reported with :meth:`Session.aborted`."""

    version: int
    what: ClassVar[str] = "the abort"


@dataclass(frozen=True, slots=True)
class Finish:
    """End vLLM's weight update; ``label`` becomes the engine's weight version."""

    label: str | None
    what: ClassVar[str] = "ending vLLM's weight update"


@dataclass(frozen=True, slots=True)
class ResetCache:
    """Reset the prefix cache (running requests recompute their KV)."""

    what: ClassVar[str] = "resetting the prefix cache"


@dataclass(frozen=True, slots=True)
class Resume:
    """Resume generation."""

    what: ClassVar[str] = "resuming generation"


@dataclass(frozen=True, slots=True)
class Relabel:
    """Set the engine's weight version to ``label``."""

    label: str
    what: ClassVar[str] = "relabelling"


#: A step the engine's ops carry out.
EngineStep = Pause | Start | Finish | ResetCache | Resume | Relabel
#: Any step a :class:`Session` returns.
Step = EngineStep | AbortWorkers


class Session:
    """The update session of one engine; see the module's table of transitions."""

    def __init__(self) -> None:
        self._phase = Phase.IDLE
        self._version: int | None = None
        self._unconfirmed: int | None = None
        self._stale_cache = False
        self._asked: Step | None = None

    def __repr__(self) -> str:
        return (
            f"<vLLM session {self._phase.name} version={self._version} "
            f"unconfirmed={self._unconfirmed} stale_cache={self._stale_cache}>"
        )

    # --- what the state says --------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def version(self) -> int | None:
        """The version of the open update (``None`` unless the phase is open)."""
        return self._version

    @property
    def unconfirmed(self) -> int | None:
        """The version whose abort got no answer: a rank may still read its buffers."""
        return self._unconfirmed

    @property
    def stale_cache(self) -> bool:
        """Weights changed since the prefix cache was last reset."""
        return self._stale_cache

    @property
    def paused(self) -> bool:
        """Generation may be paused: a resume is owed."""
        return self._phase is not Phase.IDLE

    @property
    def must_abort(self) -> bool:
        """An update is open or an abort unconfirmed: abort before the next begin."""
        return self._phase in _OPEN or self._unconfirmed is not None

    def receiving(self, version: int) -> bool:
        """Whether ``version``'s buckets are being loaded (it may be committed)."""
        return self._phase is Phase.UPDATING and self._version == version

    def check(self) -> None:
        """Raise :class:`SessionError` if the fields are not a legal combination."""
        legal = (
            (self._version is not None) == (self._phase in _OPEN)
            and (self._phase is not Phase.FINISHING or self._stale_cache)
            and (self._unconfirmed is None or self._phase in (*_CLOSED, Phase.ABORTING))
        )
        if not legal:
            raise SessionError(f"illegal state: {self!r}")

    # --- a push ---------------------------------------------------------------------

    def begin(self, version: int) -> tuple[Pause, Start]:
        """A push of ``version`` begins: pause, then start vLLM's update."""
        if self._phase not in _CLOSED or self._unconfirmed is not None:
            raise self._refuse(f"begin({version})")
        return Pause(), Start(version)

    def commit(self, version: int) -> tuple[Finish, ResetCache, Resume]:
        """Every rank holds ``version`` whole: finish (labelling), reset, resume."""
        if not self.receiving(version):
            raise self._refuse(f"commit({version})")
        return Finish(str(version)), ResetCache(), Resume()

    # --- an abort -------------------------------------------------------------------

    def abort(self) -> tuple[AbortWorkers, ...]:
        """What ends the open update (or confirms an earlier abort): ask the workers.

        Nothing when neither is owed; :meth:`resume` follows in any case.
        """
        if self._phase in _OPEN:
            assert self._version is not None
            return (AbortWorkers(self._version),)
        if self._unconfirmed is not None:
            return (AbortWorkers(self._unconfirmed),)
        return ()

    def aborted(self, *, confirmed: bool, written: bool) -> tuple[EngineStep, ...]:
        """The workers answered the abort asked for last (``confirmed``), saying
        whether any rank wrote bytes of the version (``written``); or got no answer.

        Returns the steps that end vLLM's update: ``Finish(None)``, then the
        ``"incomplete-v"`` label if weights of ``v`` may have been written.
        """
        asked = self._asked
        if not isinstance(asked, AbortWorkers):
            raise self._refuse("aborted() before AbortWorkers was asked for")
        self._asked = None
        version = asked.version
        self._unconfirmed = None if confirmed else version
        if self._phase not in _OPEN:
            return ()  # vLLM's update was ended before: only confirming
        written = written or not confirmed or self._phase is Phase.FINISHING
        if written:
            self._stale_cache = True  # the KV cached so far was computed with older weights
        self._phase = Phase.ABORTING
        if written:  # outputs must not claim a version the engine no longer holds whole
            return Finish(None), Relabel(f"incomplete-{version}")
        return (Finish(None),)

    def resume(self) -> tuple[EngineStep, ...]:
        """What lets generation go on: reset the cache if stale, then resume.

        Nothing while an update is open (an interrupted abort; the next one ends it)
        or when generation runs on a fresh cache.
        """
        if self._phase in _OPEN or not (self.paused or self._stale_cache):
            return ()
        if self._stale_cache:
            return ResetCache(), Resume()
        return (Resume(),)

    # --- carrying steps out ---------------------------------------------------------

    def asking(self, step: Step) -> None:
        """``step`` is about to be carried out; refused if not legal now."""
        phase = self._phase
        match step:
            case Pause() if phase in _CLOSED:
                self._phase = Phase.PAUSED
            case Start(version=version) if phase is Phase.PAUSED and self._unconfirmed is None:
                self._phase, self._version = Phase.UPDATING, version
            case AbortWorkers(version=version) if version == (
                self._version if phase in _OPEN else self._unconfirmed
            ):
                pass
            case Finish(label=None) if phase is Phase.ABORTING:
                pass
            case Finish(label=label) if phase is Phase.UPDATING and label == str(self._version):
                # From here on every byte is in: if finishing fails, the abort that
                # follows labels the engine incomplete whatever the workers say.
                self._phase = Phase.FINISHING
                self._stale_cache = True  # from the first byte finishing may change
            case ResetCache() | Resume() | Relabel() if phase in _CLOSED:
                pass
            case _:
                raise self._refuse(f"asking {step!r}")
        self._asked = step

    def done(self, step: Step) -> None:
        """``step``, the one asked for last, succeeded."""
        if isinstance(step, AbortWorkers):
            raise self._refuse("done(AbortWorkers): report it with aborted()")
        self._answered(step)
        match step:
            case Finish():
                self._phase, self._version = Phase.PAUSED, None
            case ResetCache():
                self._stale_cache = False
            case Resume():
                self._phase = Phase.IDLE

    def failed(self, step: Step) -> tuple[EngineStep, ...]:
        """``step``, a cleanup step asked for last, failed (and was logged); returns
        the steps to carry out before the remaining ones.

        An update whose end (``Finish(None)``) failed counts as ended: nothing more
        can end it. A reset that failed leaves the cache stale, and the engine's
        weight version says so.
        """
        if isinstance(step, AbortWorkers):
            raise self._refuse("failed(AbortWorkers): report it with aborted()")
        self._answered(step)
        match step:
            case Finish(label=None):
                self._phase, self._version = Phase.PAUSED, None
            case ResetCache():
                return (Relabel("stale-cache"),)
        return ()

    def _answered(self, step: Step) -> None:
        if self._asked != step:
            raise self._refuse(f"an answer to {step!r}, not the step asked for last")
        self._asked = None

    def _refuse(self, what: str) -> SessionError:
        return SessionError(f"{what} is not allowed in {self!r}")
