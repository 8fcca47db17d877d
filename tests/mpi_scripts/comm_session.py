"""Sessions: a failure anywhere in a ``with comm.session():`` block reaches every rank.

Run as ``mpiexec -n P python comm_session.py`` (P >= 2; P >= 4 adds the split
case) or ``mpiexec -n 2 python comm_session.py --cost``.

Without ``--cost``, for every case the rank ``BAD = P - 1`` fails at one place
while the others wait somewhere else in their own block; every rank prints
``case NAME rank r: <TypeName>: <message> [after <seconds> s] rank=<l> world=<w> abandoned=<a>``
(``l`` / ``w``: the failed rank's attributes, ``-`` for other errors; ``a``: the
channels this rank abandoned in the case). Cases:

* ``recv``: rank 0 waits in ``recv`` from BAD, the others in ``finish``;
* ``bcast``: the others wait for BAD's broadcast;
* ``reduce``: the others wait in ``allreduce_array`` (and ``sum_exact``);
* ``finish``: BAD raises at the end of its block, the others are in ``finish``;
* ``interrupt``: BAD raises a ``BaseException`` (not an ``Exception``);
* ``nested``: BAD's propagator raises in a solve inside the session;
* ``after_solve``: the solve succeeds, BAD raises afterwards in the same session;
* ``in_session``: BAD's propagator raises in a solve that runs *inside* the session
  (``comm=InSession(c)``: no handshake, no barrier of its own);
* ``in_session_setup``: BAD fails in the set-up of such a solve (its initial guess
  raises), the others wait in its cycles;
* ``reversed``: a solve on ``comm.reversed()`` where BAD fails (rank 0 there);
* ``split`` (P >= 4): the ranks split by parity; BAD fails in its half, whose
  members must name it by its world rank (and its rank in the half);
* ``after_finish``: BAD raises after an explicit ``finish`` of its block: the
  others have left theirs (no error there); BAD abandons the channel, which the
  others keep in their pools, so the next sessions must agree on another one;
* ``slow``: a rank is busy (not listening) for 1.5 s while BAD fails, and the
  cleanup limit is 0.5 s: BAD and the ranks waiting for the busy one give up
  their cleanup after 0.5 s and abandon the channel; the busy rank raises when
  it next waits.

Afterwards: sessions still work (ring exchange, reductions equal on every
rank), a session's ``share`` reaches every rank in rank order, a solve on
:class:`ReversedInSession` (inside a session, ranks in reverse) equals the serial
one bit for bit and a failure in it names the failed rank as the session's
communicator does, ``waited`` counts the time a rank waits for a message, a rank in
``agree`` against one in a session's handshake raises naming both calls, ``exact_many`` equals the single reductions bit for bit, and
a solve equals the serial one bit for bit, and sessions whose signatures differ in odd
ways (an unhashable ``what``, numpy arrays, an argument that cannot be printed) raise
ValueError on every rank: ``rank r: sessions OK``. With
``--cost`` it times empty sessions,
sessions with one reduction and, for comparison, ``MPI_Comm_dup`` + free and
``MPI_Barrier``: ``rank r: cost session <us> us, session+allreduce <us> us,
dup+free <us> us, barrier <us> us``.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import mgrit
from mgrit.comm import (Call, InSession, MPIComm, RemoteRankError, ReversedInSession, Tag, abandoned_channels,
                        as_communicator)
from propagators import Dahlquist


class Injected(RuntimeError):
    """The error raised on purpose by the failing rank."""


class Interrupt(BaseException):
    """A failure that is not an Exception (like KeyboardInterrupt)."""


class Faulty(mgrit.Propagator):
    def __init__(self, fail: bool):
        self.inner, self.fail = Dahlquist(-1.0), fail

    def step(self, u, t0, t1):
        return self.step_batch(u[None], np.array([t0]), np.array([t1]))[0]

    def step_batch(self, U, t0, t1):
        if self.fail:
            raise Injected("injected failure in the propagator")
        return self.inner.step_batch(U, t0, t1)


def solve_kw():
    return dict(cf=2, max_levels=3, relax="FCF", tol=None, max_iter=3)


def run_case(c, name: str, bad: int):
    """Run case ``name`` on communicator wrapper ``c``; return this rank's exception."""
    r = c.rank
    busy = 1 if bad != 1 else 0
    t = np.linspace(0.0, 2.0, 17)
    try:
        if name == "reversed":
            rev = c.reversed()
            try:
                mgrit.solve(Faulty(r == bad), np.array([1.0]), t, comm=rev, **solve_kw())
            finally:
                rev.free()
            return None
        if name == "split":
            half = c.split(r % 2, r)
            try:
                with half.session():
                    if r == bad:
                        raise Injected("injected failure in one half")
                    half.allreduce_array(np.ones(3))
            finally:
                half.free()
            return None
        with c.session():
            if name == "recv":
                if r == bad:
                    raise Injected("injected failure before sending")
                if r == 0:
                    c.recv(np.zeros(4), bad, Tag.USER)
            elif name == "bcast":
                if r == bad:
                    raise Injected("injected failure before broadcasting")
                c.bcast(None, root=bad)
            elif name == "reduce":
                c.sum_exact(np.ones(3))  # a reduction that succeeds first
                if r == bad:
                    time.sleep(0.1)
                    raise Injected("injected failure before reducing")
                c.allreduce_array(np.ones(1000))
            elif name == "finish":
                if r == 0:
                    c.send(np.ones(3), bad, Tag.USER)  # never received: the failure leaves it behind
                if r == bad:
                    time.sleep(0.1)
                    raise Injected("injected failure at the end of the block")
            elif name == "interrupt":
                if r == bad:
                    raise Interrupt("interrupted")
                c.bcast(None, root=bad)
            elif name == "nested":
                c.bcast("hello", root=0)
                mgrit.solve(Faulty(r == bad), np.array([1.0]), t, comm=c, **solve_kw())
            elif name == "in_session":
                mgrit.solve(Faulty(r == bad), np.array([1.0]), t, comm=InSession(c), **solve_kw())
            elif name == "in_session_setup":
                def guess(tt):
                    if r == bad:
                        raise Injected("injected failure in the initial guess")
                    return np.array([1.0])

                mgrit.solve(Faulty(False), np.array([1.0]), t, comm=InSession(c), initial_guess=guess,
                            **solve_kw())
            elif name == "after_solve":
                mgrit.solve(Faulty(False), np.array([1.0]), t, comm=c, **solve_kw())
                if r == bad:
                    raise Injected("injected failure after the solve")
                c.bcast(None, root=bad)
            elif name == "after_finish":
                c.bcast(np.ones(3), root=0)
                c.finish()
                if r == bad:
                    raise Injected("injected failure after finish")
            elif name == "slow":
                if r == busy:
                    time.sleep(1.5)
                if r == bad:
                    raise Injected("injected failure while a rank is busy")
                c.bcast(None, root=bad)
    except BaseException as exc:  # noqa: BLE001 - the point is to report whatever arrived
        return exc
    return None


def check_share_and_reversed(c) -> list:
    """The handshake's ``share`` (every rank's value, in rank order) and a :class:`ReversedInSession`
    view (numbering, messages, gather, broadcasts, world ranks, a solve equal to the serial one bit
    for bit, a failure in it reaching every rank under the caller's numbering). Returns what failed."""
    r, P, bad = c.rank, c.size, []
    s = c.session(share={"rank": r, "sq": [r * r]})
    with s:
        if s.shared != [{"rank": i, "sq": [i * i]} for i in range(P)]:
            bad.append(f"session share: {s.shared}")
        v = ReversedInSession(c)
        if (v.rank, v.size, v.world_rank(), v.world_rank(0)) != (P - 1 - r, P, c.world_rank(),
                                                                 c.world_rank(P - 1)):
            bad.append("ReversedInSession numbering")
        if P > 1:
            v.send(np.full(2, float(v.rank)), (v.rank + 1) % P, Tag.USER)
            got = v.recv(np.zeros(2), (v.rank - 1) % P, Tag.USER)
            if not np.array_equal(got, np.full(2, float((v.rank - 1) % P))):
                bad.append("ReversedInSession ring exchange")
        if v.gather(v.rank, root=None) != list(range(P)) or v.bcast(v.rank if v.rank == 0 else None, 0) != 0:
            bad.append("ReversedInSession gather / bcast")
        x = np.arange(3.0) + 10
        got = v.bcast_state(x if v.rank == 0 else None, np.zeros(3), root=0)
        if not np.array_equal(got, x):
            bad.append("ReversedInSession bcast_state")
    with c.session():  # no handshake inside a session: the share is all-gathered there
        if InSession(c).open(share=("in", r)) != [("in", i) for i in range(P)]:
            bad.append("InSession share")
    try:  # a share that cannot be pickled fails its rank in the handshake; the others hear of it
        with c.session(share=(lambda: r) if r == P - 1 else r):
            pass
        if P > 1:  # (one process shares without pickling)
            bad.append("an unpicklable share raised nothing")
    except TypeError as exc:
        if r != P - 1 or "picklable" not in str(exc):
            bad.append(f"unpicklable share: {exc}")
    except RemoteRankError as exc:
        if r == P - 1 or exc.rank != P - 1 or "picklable" not in str(exc):
            bad.append(f"unpicklable share on another rank: {exc}")
    prop, t = Dahlquist(-1.0), np.linspace(0.0, 4.0, 65)
    kw = dict(cf=2, max_levels=4, relax="FCF", tol=1e-12, max_iter=30)
    ref = mgrit.solve(prop, np.array([1.0, 0.5]), t, **kw)
    with c.session():
        res = mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=ReversedInSession(c), **kw, final_residual=True)
        whole = mgrit.gather(res, root=None)
    if not (np.array_equal(whole, ref.u) and res.residuals == ref.residuals):
        bad.append("a solve on ReversedInSession differs from the serial solve")
    starts = c.gather(res.index.start, root=None)
    if starts != sorted(starts, reverse=True):
        bad.append(f"ReversedInSession blocks not in reverse rank order: {starts}")
    try:
        with c.session():
            mgrit.solve(Faulty(r == P - 1), np.array([1.0]), np.linspace(0.0, 2.0, 17),
                        comm=ReversedInSession(c), **solve_kw())
        bad.append("a failure in a ReversedInSession solve raised nothing")
    except Injected:
        if r != P - 1:
            bad.append("the wrong rank raised Injected")
    except RemoteRankError as exc:
        if r == P - 1 or exc.rank != P - 1 or not str(exc).startswith(f"rank {c.world_rank(P - 1)}"):
            bad.append(f"ReversedInSession failure: {exc} (rank {exc.rank})")
    return bad


def check_exact_many(c) -> list:
    """``exact_many`` gives every part's ``norm2_exact`` / ``sum_exact`` / ``max``, bit for bit, in
    one reduction (parts with nothing on some ranks, NaN, huge values). Returns what failed."""
    r, bad = c.rank, []
    rng = np.random.default_rng(r)
    parts = [rng.standard_normal(5) * 10.0 ** r, np.zeros(0) if r % 2 else np.array([1e200, 3.0]),
             np.array([0.1] * (r + 1)), np.array([np.nan]) if r == c.size - 1 else np.ones(2)]
    with c.session():
        for kind, single in (("norm2", c.norm2_exact), ("sum", c.sum_exact), ("max", c.max)):
            many = c.exact_many(parts, kind)
            ones = [single(v) for v in parts]
            if len(many) != len(ones) or any(not (a == b or (a != a and b != b)) for a, b in zip(many, ones)):
                bad.append(f"exact_many {kind}: {many} != {ones}")
        if c.exact_many([], "sum") != []:
            bad.append("exact_many of no parts")
    try:
        c.exact_many(parts, "mean")
        bad.append("exact_many accepted kind 'mean'")
    except ValueError:
        pass
    return bad


def check_odd_signatures(c, bad_lines: list) -> None:
    """Signatures that differ in odd ways (an unhashable ``what``, numpy arrays, arguments that cannot be
    printed) make every rank raise ValueError in the handshake: rank 0 builds the message for every rank,
    and an exception there would leave the others waiting."""
    r, P = c.rank, c.size

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no repr")

    odd = {"unhashable what": (Call(["step", r]), "the collective calls differ"),
           "numpy signature": (np.arange(3) + (r == P - 1), "differ between ranks (rank"),
           "unprintable argument": (Call("my call", Unprintable() if r == 0 else 1), "the arguments of my call")}
    for name, (sig, part) in odd.items():
        try:
            with c.session(sig):
                pass
            bad_lines.append(f"{name}: no error")
        except ValueError as exc:
            if part not in str(exc):
                bad_lines.append(f"{name}: {exc}")


def check_waited(c, bad_lines: list, nap: float = 0.3) -> None:
    """``waited`` counts a rank's waits for the others: the ranks that receive from a rank that
    naps ``nap`` seconds first wait at least most of that (they entered their receive before it
    woke); it never decreases; a view of ``c`` (a solve's inside a session) reads ``c``'s."""
    r, P = c.rank, c.size
    view = InSession(c)
    with c.session():
        before = c.waited
        c.allreduce(1.0)  # everyone is here: the nap starts after the others posted their receives
        if r == 0:
            time.sleep(nap)
            for q in range(1, P):
                c.send(np.ones(2), q, Tag.HALO)
        else:
            c.recv(np.zeros(2), 0, Tag.HALO)
        grew = c.waited - before
        if view.waited != c.waited or ReversedInSession(c).waited != c.waited:
            bad_lines.append(f"a view's waited {view.waited} != the communicator's {c.waited}")
    if grew < 0 or (r > 0 and grew < 0.5 * nap):
        bad_lines.append(f"waited grew by {grew:.3f} s on rank {r} (rank 0 napped {nap} s before sending)")


def _session(c) -> None:
    with c.session():
        pass


def _split(c) -> None:
    part = c.split(0, c.rank)
    if part is not None:
        part.free()


def check_agree_against_a_session(c, bad_lines: list) -> None:
    """One rank in one collective call, the others in another, either way round: a session's handshake
    against ``agree`` (split_comm's), and ``split`` against both. Every rank raises ValueError naming both
    calls (rank 0 unpacked the bare value of agree as a handshake note, a TypeError, and the other ranks
    waited; the plan of a split over torch.distributed, met by a handshake, gave an unpacking error on
    rank 0), and the communicator stays usable (one process: nothing to differ)."""
    if c.size == 1:
        return
    layer_size = lambda c: c.agree(3, "`layer_size` of split_comm")  # noqa: E731
    pairs = [(_session, layer_size, "agree (`layer_size` of split_comm)", "agree against a session"),
             (_split, _session, "Communicator.split", "split against a session"),
             (_split, lambda c: c.agree(1, "a value"), "Communicator.split", "split against agree")]
    for mine, theirs, named, case in pairs:
        for first in (0, c.size - 1):
            try:
                (mine if c.rank == first else theirs)(c)
            except ValueError as exc:
                if "the collective calls differ" not in str(exc) or named not in str(exc):
                    bad_lines.append(f"{case}: unclear error {exc}")
            else:
                bad_lines.append(f"{case}, rank {first} alone: no error")
    # a bad color or key on one rank: an error there, RemoteRankError on the others (they waited in MPI's split)
    for bad, error in (("a", TypeError), (2 ** 40, ValueError)):
        try:
            part = c.split(bad if c.rank == c.size - 1 else 0, 0)
            if part is not None:
                part.free()
            bad_lines.append(f"a split color {bad!r} on one rank: no error")
        except (error, RemoteRankError) as exc:
            if (isinstance(exc, RemoteRankError) == (c.rank == c.size - 1)
                    or "split(color, key) takes integers" not in str(exc)):
                bad_lines.append(f"a split color {bad!r} on one rank: {type(exc).__name__}: {exc}")
    part = c.split(-(2 ** 40) if c.rank == c.size - 1 else 0)  # (any negative color: undefined, never refused)
    if (part is None) != (c.rank == c.size - 1) or (part is not None and part.size != c.size - 1):
        bad_lines.append(f"a large negative split color: {part}")
    if part is not None:
        part.free()
    part = c.split(c.rank % 2, -c.rank)  # (usable, and a split still splits)
    want = sorted((r for r in range(c.size) if r % 2 == c.rank % 2), reverse=True)
    if part.size != len(want) or part.rank != want.index(c.rank):
        bad_lines.append(f"split after the mismatches: rank {part.rank} of {part.size}, want "
                         f"{want.index(c.rank)} of {len(want)}")
    part.free()
    c.agree(5, "a value")  # (usable)
    try:
        c.agree(c.rank, "`layer_size` of split_comm")
        bad_lines.append("agree of different values: no error")
    except ValueError as exc:
        if "`layer_size` of split_comm differs between ranks" not in str(exc):
            bad_lines.append(f"agree of different values: {exc}")


def check_clean(c, bad_lines: list) -> None:
    """Sessions, reductions and a solve work after the failures."""
    r, P = c.rank, c.size
    for _ in range(3):
        with c.session():
            c.send(np.full(3, float(r)), (r + 1) % P, Tag.HALO)
            got = c.recv(np.zeros(3), (r - 1) % P, Tag.HALO)
            if not np.array_equal(got, np.full(3, float((r - 1) % P))):
                bad_lines.append("ring exchange after the failures")
            s = c.allreduce_array(np.array([0.1 * (r + 1), 1.0]))
            every = c.gather(s.tolist(), root=None)
            if any(e != every[0] for e in every) or s[1] != P:
                bad_lines.append("allreduce_array differs between ranks")
            if c.sum_exact(np.full(10, 0.1)) != __import__("math").fsum([0.1] * 10 * P):
                bad_lines.append("sum_exact")
            if c.max([float(r)]) != P - 1 or c.allreduce(1.0) != P or c.allreduce(float(r), "max") != P - 1:
                bad_lines.append("max / allreduce")
            for root in range(P):  # raw states from every root: numpy and torch, the root's bits everywhere
                x = np.arange(6.0).reshape(2, 3) / (root + 3)
                got = c.bcast_state(x if r == root else None, np.zeros((2, 3)), root=root)
                if got.dtype != x.dtype or not np.array_equal(got, x):
                    bad_lines.append(f"bcast_state of a numpy state from rank {root}")
                import torch

                y = torch.arange(4, dtype=torch.float32) / (root + 7)
                got = c.bcast_state(y if r == root else None, torch.empty(4), root=root)
                if not (isinstance(got, torch.Tensor) and torch.equal(got, y)):
                    bad_lines.append(f"bcast_state of a torch state from rank {root}")
            c.finish()  # an explicit finish inside the block (the exit does not repeat it)
    prop, t = Dahlquist(-1.0), np.linspace(0.0, 4.0, 65)
    kw = dict(cf=2, max_levels=4, relax="FCF", tol=1e-12, max_iter=30)
    ref = mgrit.solve(prop, np.array([1.0, 0.5]), t, **kw)
    with c.session():
        res = mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=c, **kw)
        whole = mgrit.gather(res, root=None)
    if not (np.array_equal(whole, ref.u) and res.residuals == ref.residuals):
        bad_lines.append("the solve after the failures differs from the serial solve")
    for _ in range(2):  # inside the caller's session: the same bits, and the session stays usable
        with c.session():
            res = mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=InSession(c), **kw, final_residual=True)
            whole = mgrit.gather(res, root=None)
            after = c.allreduce(1.0)
        if not (np.array_equal(whole, ref.u) and res.residuals == ref.residuals and after == P):
            bad_lines.append("a solve inside the session differs from the serial solve")
    bad_lines += check_share_and_reversed(c) + check_exact_many(c)
    try:
        mgrit.solve(prop, np.array([1.0, 0.5]), t, comm=InSession(c), **kw)
        bad_lines.append("InSession without an open session did not raise")
    except RuntimeError as exc:
        if "needs a session open" not in str(exc):
            bad_lines.append(f"InSession without a session: {exc}")


def cost(world) -> int:
    """Per-call microseconds (the best of 5 batches of 400, against noise from other load)."""
    c = as_communicator(world)
    for _ in range(50):  # warm up (the first session duplicates its channel)
        with c.session():
            pass

    def empty():
        with c.session():
            pass

    def reduce():
        with c.session():
            c.allreduce(1.0)

    def best(fn, n=400):
        times = []
        for _ in range(5):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append(1e6 * (time.perf_counter() - t0) / n)
        return min(times)

    us = [best(f) for f in (empty, reduce, lambda: world.Dup().Free(), world.Barrier)]
    print(f"rank {world.Get_rank()}: cost session {us[0]:.1f} us, session+allreduce {us[1]:.1f} us, "
          f"dup+free {us[2]:.1f} us, barrier {us[3]:.1f} us; channels made {c._next_id}", flush=True)
    return 0


def main() -> int:
    from mpi4py import MPI  # here, so that importing this file (pytest collection) starts no MPI

    world = MPI.COMM_WORLD
    if "--cost" in sys.argv:
        return cost(world)
    c = as_communicator(world)
    r, P = c.rank, c.size
    bad = P - 1
    names = ["recv", "bcast", "reduce", "finish", "interrupt", "nested", "in_session", "in_session_setup",
             "after_solve", "reversed"]
    names += ["split"] if P >= 4 else []
    names += ["after_finish", "slow"]
    for name in names:
        before = abandoned_channels()
        c.cleanup_timeout = 0.5 if name == "slow" else MPIComm.cleanup_timeout
        start = time.perf_counter()
        exc = run_case(c, name, bad)
        elapsed = time.perf_counter() - start
        tail = f"[after {elapsed:.2f} s]"
        if exc is None:
            tail += " rank=- world=-"
            print(f"case {name} rank {r}: no error {tail} abandoned={abandoned_channels() - before}", flush=True)
        else:
            tail += f" rank={getattr(exc, 'rank', '-')} world={getattr(exc, 'world_rank', '-')}"
            print(f"case {name} rank {r}: {type(exc).__name__}: {exc} {tail} "
                  f"abandoned={abandoned_channels() - before}", flush=True)
    c.cleanup_timeout = MPIComm.cleanup_timeout
    bad_lines: list = []
    check_odd_signatures(c, bad_lines)
    check_clean(c, bad_lines)
    check_waited(c, bad_lines)
    check_agree_against_a_session(c, bad_lines)
    for line in bad_lines:
        print(f"rank {r}: MISMATCH {line}", flush=True)
    if not bad_lines:
        print(f"rank {r}: sessions OK", flush=True)
    return 1 if bad_lines else 0


if __name__ == "__main__":
    sys.exit(main())
