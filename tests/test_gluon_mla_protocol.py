# SPDX-License-Identifier: Apache-2.0
"""CPU models of the Gluon MLA kernel (``attention_backends/mla_tree/gluon_kernel.py``,
the warp-specialized "seesaw"): its mbarrier protocol and its softmax arithmetic.

THESE ARE HAND-WRITTEN MODELS OF THE KERNEL, NOT TESTS OF ITS CODE. :func:`schedule`
transcribes, step by step, what ``_seesaw_partition`` does for each warpgroup (which
mbarrier it waits on with which phase parity, where it arrives, which shared buffer
each step reads, stores or refills by cp.async); :func:`seesaw_numerics` transcribes
its arithmetic (shared running max, rescales ``sc0``/``sc1``, ``l = l0 + l1``, lse).
Nothing here reads the kernel's source: ANY CHANGE TO THE KERNEL'S SCHEDULE OR
ARITHMETIC MUST BE MIRRORED HERE, or these tests prove nothing about it.

Hardware facts the protocol model relies on (checked in the PTX that triton 3.6 emits
for the kernel, ``tests/test_mla_gluon_kernel_compile.py`` compiles it offline):

* ``mbarrier.arrive`` (Gluon) is one elected arrive: ``bar.sync`` of the partition's
  128 threads, then ``@(tid % 128 == 0) mbarrier.arrive`` (count 1, release.cta).
* ``async_copy.mbarrier_arrive(bar, increment_count=False)`` is
  ``cp.async.mbarrier.arrive.noinc`` executed by EVERY thread of the partition: each of
  the 128 threads decrements the pending count by one once all of ITS earlier cp.asyncs
  landed. So one ``_load_kv_part`` call of one warpgroup = 128 arrivals, and the KV barriers
  (``count=256``) complete a phase when both warpgroups' shares of a tile have landed.
* ``mbarrier.wait(bar, parity)`` is ``try_wait.parity``: it passes iff the phase with
  that parity completed, i.e. ``completed_phases % 2 != parity``; if the barrier ran two
  phases ahead of a waiter, the waiter blocks forever (or passes on a wrong phase).
* The two partitions are 4 warps each (default = warpgroup 0, worker = warpgroup 1);
  a CTA with nothing to do (empty split, or a row block past the rows) returns BEFORE
  the barriers are initialized and before the fork (the worker warps get the exit
  state), so no warpgroup ever waits there.

The protocol model explores EVERY interleaving of the two warpgroups' steps and of the
(asynchronous, per-warpgroup in-order) landing of their cp.async groups, and fails on
a deadlock, on a wait that passes on the wrong phase or a barrier that runs a phase
ahead of a pending waiter, on a read of a buffer whose content is not the expected
tile / P / statistic (overwritten early, or not yet landed), and on any write (store
or cp.async) to a buffer that an in-flight wgmma of either warpgroup still reads.

Not modeled (checked by reading the PTX, or only on a GPU): the generic/async proxy
fences (``fence_async_shared`` after each KV wait, after each P store, and before the
wgmmas that read V halves a warpgroup loaded itself but saw land only through the
other's hand-off), the partition-local ``bar.sync`` that Triton inserts between a
warpgroup's own shared loads and stores, and anything about registers or timing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

THREADS_PER_WARPGROUP = 4 * 32  # one noinc cp.async arrive per thread
KV_BARRIER_COUNT = 2 * THREADS_PER_WARPGROUP  # mbarrier.init(count=256)
BARRIER_COUNTS = {"KV0": KV_BARRIER_COUNT, "KV1": KV_BARRIER_COUNT, "SC0": 1, "SC1": 1,
                  "P0": 1, "P1": 1, "FIN0": 1, "FIN1": 1}
BARRIERS = tuple(BARRIER_COUNTS)
# Shared buffers: KV buffer b = lo_b | hi_b (K columns 0..255 | 256..511 = V halves) |
# r_b (rope; P of the pair once S of its tile retired); fp32 row statistics.
SLOTS = ("lo0", "hi0", "r0", "lo1", "hi1", "r1", "M", "SC0", "SC1", "L0", "L1")


class ProtocolError(AssertionError):
    pass


def schedule(num_tiles: int, mutation: str | None = None) -> tuple[list, list]:
    """The steps of warpgroup 0 and 1 for a split of ``num_tiles`` 64-key tiles,
    transcribed from ``_seesaw_partition`` (``mutation``: a deliberate bug, to show that
    the checker catches it). Steps:

    ``("cp", ((slot, content), ...), bar)``: cp.async of a share of a tile, then the
    128 noinc arrivals on ``bar`` (asynchronous: when the group lands); ``bar`` None:
    no arrive (``_load_kv_part(..., pred=...)``);
    ``("cparrive", bar)``: a separate ``async_copy.mbarrier_arrive`` (noinc: its 128
    arrivals come once all of the warpgroup's earlier cp.asyncs landed);
    ``("wait", bar, parity, k)``: ``mbarrier.wait(bar, parity)`` meant for phase ``k``;
    ``("arrive", bar)``: the elected ``mbarrier.arrive``;
    ``("mma", tag, ((slot, expected), ...))``: an async wgmma reading shared buffers,
    in flight until ``("retire", tag)`` (``warpgroup_mma_wait``);
    ``("ld", slot, expected)`` / ``("st", slot, content)``: shared loads / stores;
    ``("drain",)``: ``async_copy.commit_group(); wait_group(0)``.
    """
    if num_tiles == 0:
        # split_start >= split_end: lse = -inf, return before mbarrier.init and the fork.
        return [], []
    num_pairs = math.ceil(num_tiles / 2)  # an odd count runs one fully masked tile

    def kv(t):
        return ("kv", t)

    def rope(t):
        return ("rope", t)

    def parity(p):
        return 0 if mutation == "parity_always_0" else p & 1

    wg0 = [("cp", (("lo0", kv(0)),), "KV0"),
           ("cp", (("lo1", kv(1)), ("r1", rope(1))), "KV1")]
    wg1 = [("cp", (("hi0", kv(0)), ("r0", rope(0))), "KV0"),
           ("cp", (("hi1", kv(1)),), "KV1")]
    for p in range(num_pairs):
        a, b = 2 * p, 2 * p + 1
        more = p + 1 < num_pairs
        m_prev = ("m1", p - 1) if p else ("m", "init")
        # Warpgroup 0: S0 = Q K(a)^T, softmax, publish m / sc0, P0 V_L(a), P0 sc1 -> r0,
        # refill V_L of buffer 0, P1 V_L(b), refill V_L + rope of buffer 1.
        wg0 += [
            ("wait", "KV0", parity(p), p),
            ("mma", "s0", (("lo0", kv(a)), ("hi0", kv(a)), ("r0", rope(a)))),
            ("retire", "s0"),
            ("ld", "M", m_prev),
            ("st", "M", ("m0", p)),
            ("st", "SC0", ("sc0", p)),
            ("arrive", "SC0"),
            ("mma", "pv_a", (("lo0", kv(a)),)),
            ("retire", "pv_a"),
            ("wait", "SC1", parity(p), p),
            ("ld", "SC1", ("sc1", p)),
            ("st", "r0", ("P0", p)),
            ("arrive", "P0"),
        ]
        if more:
            wg0.append(("cp", (("lo0", kv(a + 2)),), "KV0"))
        if mutation != "wg0_skips_p1_wait":
            wg0.append(("wait", "P1", parity(p), p))
        wg0 += [("mma", "pv_b", (("r1", ("P1", p)), ("lo1", kv(b)))),
                ("retire", "pv_b")]
        if more:
            wg0.append(("cp", (("lo1", kv(b + 2)), ("r1", rope(b + 2))), "KV1"))
        # Warpgroup 1: S1 = Q K(b)^T, wait m / sc0, publish m / sc1, P1 -> r1,
        # P1 V_R(b) and (P0 sc1) V_R(a) in flight together, refills of V_R (buffer 1,
        # predicated: zeros without a next pair; its arrive only with one, after the
        # wgmma wait(0)) and V_R + rope (buffer 0).
        wg1 += [
            ("wait", "KV1", parity(p), p),
            ("mma", "s1", (("lo1", kv(b)), ("hi1", kv(b)), ("r1", rope(b)))),
            ("retire", "s1"),
            ("wait", "SC0", parity(p), p),
            ("ld", "M", ("m0", p)),
            ("st", "M", ("m1", p)),
            ("ld", "SC0", ("sc0", p)),
            ("st", "SC1", ("sc1", p)),
            ("arrive", "SC1"),
            ("st", "r1", ("P1", p)),
            ("arrive", "P1"),
            ("mma", "pv_b", (("hi1", kv(b)),)),
            ("wait", "P0", parity(p), p),
            ("mma", "pv_a", (("r0", ("P0", p)), ("hi0", kv(a)))),
        ]
        refill_b = ("cp", (("hi1", kv(b + 2) if more else ("zero", b + 2)),), None)
        refill_a = [("cparrive", "KV1"),
                    ("cp", (("hi0", kv(a + 2)), ("r0", rope(a + 2))), "KV0")]
        if mutation == "wg1_refills_buffer0_early":
            wg1 += [("retire", "pv_b"), refill_b] + (refill_a if more else [])
            wg1.append(("retire", "pv_a"))
        else:
            wg1 += [("retire", "pv_b"), refill_b, ("retire", "pv_a")]
            if more:
                wg1 += refill_a
    last = ("m1", num_pairs - 1)
    for w, prog in enumerate((wg0, wg1)):
        prog += [("drain",), ("st", f"L{w}", ("l", w)), ("arrive", f"FIN{w}"),
                 ("wait", f"FIN{1 - w}", 0, 0), ("ld", f"L{1 - w}", ("l", 1 - w))]
    wg0.append(("ld", "M", last))
    return wg0, wg1


def explore(num_tiles: int, mutation: str | None = None, counts=None) -> dict:
    """All interleavings of :func:`schedule` (memoized DFS). Returns ``{"states": n,
    "final": {barrier: (completed phases, pending arrivals)}}`` (one entry per distinct
    final barrier state); raises :class:`ProtocolError` on the first violation."""
    counts = dict(BARRIER_COUNTS, **(counts or {}))
    progs = schedule(num_tiles, mutation)
    bar_ix = {b: i for i, b in enumerate(BARRIERS)}
    slot_ix = {s: i for i, s in enumerate(SLOTS)}
    init_contents = tuple(("m", "init") if s == "M" else None for s in SLOTS)
    start = (0, 0, tuple((0, 0) for _ in BARRIERS), init_contents, ((), ()), frozenset())
    seen, finals, stack = set(), {}, [start]

    def fail(msg, state, w=None):
        pcs = state[0], state[1]
        where = "" if w is None else f" (warpgroup {w}, step {pcs[w]}: {progs[w][pcs[w]]})"
        raise ProtocolError(f"num_tiles={num_tiles}: {msg}{where}; pcs={pcs}, "
                            f"barriers={dict(zip(BARRIERS, state[2], strict=True))}")

    def arrive(bars, name, n, state):
        bars = list(bars)
        done, pending = bars[bar_ix[name]]
        pending += n
        if pending > counts[name]:
            fail(f"{name}: {pending} arrivals in a phase of count {counts[name]}", state)
        if pending == counts[name]:
            done, pending = done + 1, 0
            # A waiter still to pass phase k < done - 1 can never see it (parity).
            for w in (0, 1):
                for op in progs[w][state[w]:]:
                    if op[0] == "wait" and op[1] == name and op[3] < done - 1:
                        fail(f"{name} completed phase {done - 1} while warpgroup {w} "
                             f"has not passed its wait for phase {op[3]}", state)
        bars[bar_ix[name]] = (done, pending)
        return tuple(bars)

    def check_write(slot, readers, queues, state, w):
        busy = [r for r in readers if r[2] == slot]
        if busy:
            fail(f"write to {slot} while wgmma {busy} still reads it", state, w)
        if any(slot == s for q in queues for grp in q for s, _ in grp[0]):
            fail(f"write to {slot} while a cp.async to it is in flight", state, w)

    def check_read(slot, expected, contents, queues, state, w):
        if any(slot == s for q in queues for grp in q for s, _ in grp[0]):
            fail(f"read of {slot} while a cp.async to it is in flight", state, w)
        got = contents[slot_ix[slot]]
        if got != expected:
            fail(f"read of {slot}: expected {expected}, found {got}", state, w)

    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        pc0, pc1, bars, contents, queues, readers = state
        succ = []
        for w in (0, 1):
            pc = state[w]
            if pc == len(progs[w]):
                continue
            op = progs[w][pc]
            pcs = [pc0, pc1]
            pcs[w] += 1
            nb, nc, nq, nr = bars, contents, queues, readers
            kind = op[0]
            if kind == "wait":
                done = bars[bar_ix[op[1]]][0]
                if done % 2 == op[2]:
                    continue  # blocked
                if done != op[3] + 1:
                    fail(f"wait on {op[1]} passed on phase {done - 1}, meant {op[3]}",
                         state, w)
            elif kind == "arrive":
                nb = arrive(bars, op[1], 1, state)
            elif kind in ("cp", "cparrive"):
                writes, bar = (op[1], op[2]) if kind == "cp" else ((), op[1])
                for slot, _ in writes:
                    check_write(slot, readers, queues, state, w)
                q = list(queues)
                q[w] = q[w] + ((writes, bar),)
                nq = tuple(q)
            elif kind == "mma":
                for slot, expected in op[2]:
                    check_read(slot, expected, contents, queues, state, w)
                nr = readers | {(w, op[1], slot) for slot, _ in op[2]}
            elif kind == "retire":
                nr = frozenset(r for r in readers if r[:2] != (w, op[1]))
            elif kind == "ld":
                check_read(op[1], op[2], contents, queues, state, w)
            elif kind == "st":
                check_write(op[1], readers, queues, state, w)
                c = list(contents)
                c[slot_ix[op[1]]] = op[2]
                nc = tuple(c)
            elif kind == "drain":
                if queues[w]:
                    continue  # cp.async.wait_group 0 blocks until its copies landed
            else:
                raise AssertionError(op)
            succ.append((pcs[0], pcs[1], nb, nc, nq, nr))
        for w in (0, 1):
            if queues[w]:  # the oldest cp.async group of warpgroup w lands
                (writes, bar), rest = queues[w][0], queues[w][1:]
                c = list(contents)
                for slot, content in writes:
                    c[slot_ix[slot]] = content
                q = list(queues)
                q[w] = rest
                nb = bars if bar is None else arrive(bars, bar, THREADS_PER_WARPGROUP, state)
                succ.append((pc0, pc1, nb, tuple(c), tuple(q), readers))
        if not succ:
            if (pc0, pc1) != (len(progs[0]), len(progs[1])) or readers:
                blocked = [progs[w][state[w]] for w in (0, 1) if state[w] < len(progs[w])]
                fail(f"deadlock: blocked on {blocked}", state)
            finals[bars] = True
        stack.extend(succ)
    return {"states": len(seen),
            "final": [dict(zip(BARRIERS, f, strict=True)) for f in finals]}


@pytest.mark.parametrize("num_tiles", range(0, 7))
def test_protocol_has_no_deadlock_race_or_phase_slip(num_tiles):
    result = explore(num_tiles)
    assert result["final"], result
    num_pairs = math.ceil(num_tiles / 2)
    for final in result["final"]:
        if num_tiles == 0:
            assert all(v == (0, 0) for v in final.values()), final  # never initialized
            continue
        # Every pair completes each hand-off barrier once; the KV buffers once a pair
        # (the prologue's tiles 0 / 1, then one refill a pair but the last), and no
        # arrival is left pending at exit (none can land after the CTA is gone).
        for name in ("SC0", "SC1", "P0", "P1", "KV0", "KV1"):
            assert final[name] == (num_pairs, 0), final
        assert final["FIN0"] == final["FIN1"] == (1, 0), final


@pytest.mark.parametrize("mutation, counts, match", [
    ("parity_always_0", None, "phase|deadlock"),
    ("wg0_skips_p1_wait", None, "r1|lo1"),
    ("wg1_refills_buffer0_early", None, "hi0|r0"),
    (None, {"KV0": THREADS_PER_WARPGROUP, "KV1": THREADS_PER_WARPGROUP}, "."),
    (None, {"KV0": 3 * THREADS_PER_WARPGROUP}, "deadlock"),
])
def test_protocol_checker_catches_seeded_bugs(mutation, counts, match):
    """The model is not vacuous: a wrong parity, a missing hand-off, an early refill
    and a wrong KV arrival count are each reported (for some tile count <= 6)."""
    with pytest.raises(ProtocolError, match=match):
        for n in range(1, 7):
            explore(n, mutation, counts)


# ---------------------------------------------------------------- arithmetic model


def seesaw_numerics(s, visible, v, qk_scale, block_n):
    """The kernel's arithmetic on one split (float64 numpy; P not rounded to 16 bits):
    ``s`` ``[M, N]`` raw ``q . k``, ``visible`` bool ``[M, N]`` (False also past the
    split end, so the dummy tile of an odd tile count is fully masked), ``v``
    ``[N, 2 VH]``, ``N`` a multiple of ``2 block_n``. Returns ``out [M, 2 VH]`` and
    ``lse [M]`` (natural log) as warpgroup 0 (V columns ``:VH``) and warpgroup 1
    (``VH:``) compute them, the pair's steps in the order of the hand-offs."""
    rows, n = s.shape
    vh = v.shape[1] // 2
    assert n % (2 * block_n) == 0
    stat_m = np.full(rows, -np.inf)  # STAT_M, initialized by the default warps
    acc = [np.zeros((rows, vh)), np.zeros((rows, vh))]
    l_i = [np.zeros(rows), np.zeros(rows)]

    def softmax_part(t, m_old):
        cols = slice(t * block_n, (t + 1) * block_n)
        st = np.where(visible[:, cols], s[:, cols] * qk_scale, -np.inf)
        m_new = np.maximum(m_old, st.max(axis=1))
        m_base = np.where(m_new == -np.inf, 0.0, m_new)
        sc = np.exp2(m_old - m_base)
        p = np.exp2(st - m_base[:, None])
        return m_new, sc, p, v[cols]

    for pair in range(n // (2 * block_n)):
        a, b = 2 * pair, 2 * pair + 1
        # warpgroup 0
        m0, sc0, p0, v_a = softmax_part(a, stat_m)
        stat_m = m0
        l_i[0] = l_i[0] * sc0 + p0.sum(axis=1)
        acc[0] = acc[0] * sc0[:, None] + p0 @ v_a[:, :vh]
        # warpgroup 1 (after sc0 is published)
        m1, sc1, p1, v_b = softmax_part(b, stat_m)
        stat_m = m1
        both = sc0 * sc1
        l_i[1] = l_i[1] * both + p1.sum(axis=1)
        acc[1] = acc[1] * both[:, None] + p1 @ v_b[:, vh:] + (p0 * sc1[:, None]) @ v_a[:, vh:]
        # warpgroup 0 (after sc1 / P1)
        l_i[0] = l_i[0] * sc1
        acc[0] = acc[0] * sc1[:, None] + p1 @ v_b[:, :vh]
    outs, lse = [], None
    for w in (0, 1):
        l_tot = l_i[w] + l_i[1 - w]
        seen = l_tot > 0.0
        if w == 0:
            lse = np.where(seen, (stat_m + np.log2(np.where(seen, l_tot, 1.0))) * math.log(2),
                           -np.inf)
        outs.append(acc[w] * (1.0 / np.where(seen, l_tot, 1.0))[:, None])
    return np.concatenate(outs, axis=1), lse


def _reference(s, visible, v, scale):
    out = np.zeros((s.shape[0], v.shape[1]))
    lse = np.full(s.shape[0], -np.inf)
    for i in range(s.shape[0]):
        keys = np.nonzero(visible[i])[0]
        if keys.size:
            x = s[i, keys] * scale
            mx = x.max()
            w = np.exp(x - mx)
            lse[i] = mx + np.log(w.sum())
            out[i] = (w / w.sum()) @ v[keys]
    return out, lse


@pytest.mark.parametrize("num_tiles", range(1, 7))
def test_seesaw_arithmetic_matches_softmax(num_tiles):
    """Shared running max and rescales, ``l = l0 + l1``, natural-log lse; rows that see
    no key (or only keys of one warpgroup's tiles, or only the last tile) end with
    ``out = 0, lse = -inf`` or the exact softmax, and no NaN is ever produced (numpy
    raises on ``-inf - -inf``)."""
    rng = np.random.default_rng(num_tiles)
    block_n, rows, vh = 4, 12, 3
    n_real = num_tiles * block_n - int(rng.integers(0, block_n))  # ragged split end
    n = 2 * math.ceil(num_tiles / 2) * block_n
    s = rng.normal(size=(rows, n)) * 4.0
    v = rng.normal(size=(n, 2 * vh))
    visible = rng.random((rows, n)) < 0.5
    visible[0] = False  # sees nothing
    visible[1] = False
    visible[1, n_real - 1] = True  # only the split's last key
    tiles = np.arange(n) // block_n
    visible[2] = tiles % 2 == 0  # only warpgroup 0's tiles
    visible[3] = tiles % 2 == 1  # only warpgroup 1's tiles
    visible[4] = False
    visible[4, 0] = True  # only the first key: later maxima come from -inf rows
    visible[5] = False
    visible[5, (num_tiles - 1) * block_n] = True  # only the last real tile
    s[6, :] = -1e4  # huge negative scores: underflow, but a finite max
    visible[:, n_real:] = False  # past the split end (and the dummy tile)
    scale = 0.7
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        out, lse = seesaw_numerics(s, visible, v, scale * math.log2(math.e), block_n)
    ref_out, ref_lse = _reference(s, visible, v, scale)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert (lse[~finite] == -np.inf).all() and (out[~finite] == 0.0).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-10)
