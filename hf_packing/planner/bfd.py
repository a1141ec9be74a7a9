"""Best-fit decreasing for one window: tokens only (bisect over sorted keys) and with image/patch budgets.

Mixed into [`~hf_packing.planner.StreamingPlanner`]; works on its settings and open-bin state.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Sorted-key encoding for bfd: key = remaining_tokens << _SHIFT | bin_id. One Python int per open
# bin keeps `bisect` on the C fast path; ties on remaining room go to the oldest bin.
_SHIFT = 40
_MASK = (1 << _SHIFT) - 1


class _BestFit:
    """`"bfd"`: longest first, into the open pack with the least token room that fits every budget."""

    max_length: int
    max_open_bins: int | None
    repack_windows: int
    repack_budget: int | None
    _open: dict[int, list[Any]]
    _next_id: int

    def _window_bfd(
        self,
        idx: list[int],
        lens: list[int],
        imgs: list[int] | None,
        pats: list[int] | None,
        final: bool,
        born_of: dict[int, int] | None = None,
    ) -> list[list[int]]:
        s_idx, s_len, s_img, s_pat = self._sorted_window(idx, lens, imgs, pats)
        # Per-sample sizes of every bin this window touches, so that a bin left open can be re-planned
        # by the next window; not needed when nothing will be re-planned.
        track = not final and self.repack_windows > 0 and self.max_open_bins != 0 and self.repack_budget != 0
        if s_img is None:
            rems, per_item = self._bfd_tokens_only(s_idx, s_len, track)
        else:
            assert s_pat is not None
            rems, per_item = self._bfd_media(s_idx, s_len, s_img, s_pat, track)
        return self._finish_window(rems, final, per_item, born_of)

    def _bfd_tokens_only(
        self, s_idx: list[int], s_len: list[int], track: bool
    ) -> tuple[list[tuple[int, int]], dict[int, list[int]] | None]:
        """Best fit on tokens: bisect over sorted keys `remaining << _SHIFT | bin_id`.

        With `track`, also returns bin_id -> tokens of its samples placed in this window (complete
        for the bins this window created; carried-over bins are never re-planned).
        """
        ml = self.max_length
        sh = _SHIFT
        mask = _MASK
        open_bins = self._open
        items_of: dict[int, list[int]] = {bid: b[0] for bid, b in open_bins.items()}
        # Carried-over bins collect their lengths in a list nobody reads.
        lens_of: dict[int, list[int]] | None = {bid: [] for bid in open_bins} if track else None
        keys = sorted(((ml - b[1]) << sh) | bid for bid, b in open_bins.items())
        next_id = self._next_id
        bl = bisect_left
        for x, length in zip(s_idx, s_len):
            need = length << sh
            pos = bl(keys, need)
            if pos < len(keys):
                k = keys[pos] - need
                new_pos = bl(keys, k, 0, pos)
                if new_pos == pos:
                    keys[pos] = k
                else:
                    del keys[pos]
                    keys.insert(new_pos, k)
                bid = k & mask
                items_of[bid].append(x)
                if lens_of is not None:
                    lens_of[bid].append(length)
            else:
                k = ((ml - length) << sh) | next_id
                keys.insert(bl(keys, k), k)
                items_of[next_id] = [x]
                if lens_of is not None:
                    lens_of[next_id] = [length]
                next_id += 1
        self._next_id = next_id
        rems = [(k >> sh, k & mask) for k in keys]
        rem_of = {bid: r for r, bid in rems}
        # Bin ids only grow, so sorting them restores creation order.
        self._open = {bid: [items_of[bid], ml - rem_of[bid], 0, 0] for bid in sorted(items_of)}
        return rems, lens_of

    def _bfd_media(
        self, s_idx: list[int], s_len: list[int], s_img: list[int], s_pat: list[int], track: bool
    ) -> tuple[list[tuple[int, int]], dict[int, list[list[int]]] | None]:
        """Best fit with image/patch budgets.

        Fast path: the same sorted keys as `_bfd_tokens_only`; the first few token-feasible bins
        (tightest first) are checked against the image/patch budgets. If none of them fits, an exact
        query runs on a max segment tree indexed by remaining token room: leaf `r` holds the bins
        with exactly `r` tokens of room, and every node stores an upper bound of the image room and
        of the patch room of the bins below it. The query walks right from leaf `length` to the
        smallest room holding a bin that fits every budget (ties: oldest bin), backtracking past
        nodes whose bounds are loose (stale, or the two maxima come from different bins) and
        tightening them on the way. Updates only ever raise bounds, which is cheap; a bound that got
        stale when a bin left its leaf is repaired by the first query that trips over it. The tree
        is built on the first fallback of a window, so windows where the budgets never bind do not
        pay for it. `track`: as in `_bfd_tokens_only`, with the samples' images and patches too.
        """
        ml = self.max_length
        mi, mp = self._media_limits()
        sh = _SHIFT
        mask = _MASK
        bl = bisect_left
        items_of: dict[int, list[int]] = {}
        img_of: dict[int, int] = {}
        pat_of: dict[int, int] = {}
        rem_of: dict[int, int] = {}
        for bid, b in self._open.items():
            items_of[bid], rem_of[bid], img_of[bid], pat_of[bid] = b[0], ml - b[1], b[2], b[3]
        keys = sorted(((ml - b[1]) << sh) | bid for bid, b in self._open.items())

        size = 1
        while size < ml + 1:
            size <<= 1
        buckets: dict[int, list[int]] = {}
        imx: list[int] = []
        pmx: list[int] = []
        live = False

        def raise_leaf(r: int, a: int, c: int) -> None:
            i = r + size
            while i and (imx[i] < a or pmx[i] < c):
                if imx[i] < a:
                    imx[i] = a
                if pmx[i] < c:
                    pmx[i] = c
                i >>= 1

        def build() -> None:
            nonlocal imx, pmx, live
            live = True
            imx = [-1] * (2 * size)
            pmx = [-1] * (2 * size)
            for bid, r in rem_of.items():
                buckets.setdefault(r, []).append(bid)
                raise_leaf(r, mi - img_of[bid], mp - pat_of[bid])

        def query(length: int, im: int, pa: int) -> int:
            room_i = mi - im
            room_p = mp - pa
            i = length + size
            while True:
                if imx[i] >= im and pmx[i] >= pa:
                    if i < size:
                        i <<= 1
                        continue
                    found = -1
                    a = c = -1
                    for b in buckets.get(i - size, ()):
                        bi, bp = img_of[b], pat_of[b]
                        if bi <= room_i and bp <= room_p and (found < 0 or b < found):
                            found = b
                        if mi - bi > a:
                            a = mi - bi
                        if mp - bp > c:
                            c = mp - bp
                    if found >= 0:
                        return found
                    imx[i] = a  # exact again
                    pmx[i] = c
                while i & 1:
                    i >>= 1
                    if i == 0:
                        return -1
                    lo = 2 * i
                    imx[i] = imx[lo] if imx[lo] >= imx[lo + 1] else imx[lo + 1]
                    pmx[i] = pmx[lo] if pmx[lo] >= pmx[lo + 1] else pmx[lo + 1]
                i += 1

        next_id = self._next_id
        # bin_id -> [tokens, images, patches] of the samples placed in this window (with `track`).
        sizes_of: dict[int, list[list[int]]] | None = (
            {bid: [[], [], []] for bid in self._open} if track else None
        )
        for x, length, im, pa in zip(s_idx, s_len, s_img, s_pat):
            room_i = mi - im
            room_p = mp - pa
            need = length << sh
            pos = bl(keys, need)
            n = len(keys)
            end = pos + 8 if pos + 8 < n else n
            found = -1
            while pos < end:
                b = keys[pos] & mask
                if img_of[b] <= room_i and pat_of[b] <= room_p:
                    found = b
                    break
                pos += 1
            else:
                if pos < n:
                    if not live:
                        build()
                    found = query(length, im, pa)
                    if found >= 0:
                        pos = bl(keys, (rem_of[found] << sh) | found)
            if found >= 0:
                r = rem_of[found]
                k = keys[pos] - need
                new_pos = bl(keys, k, 0, pos)
                if new_pos == pos:
                    keys[pos] = k
                else:
                    del keys[pos]
                    keys.insert(new_pos, k)
                if live:
                    buckets[r].remove(found)  # leaf r keeps a (now possibly stale) upper bound
                r -= length
                rem_of[found] = r
                img_of[found] += im
                pat_of[found] += pa
                items_of[found].append(x)
                if sizes_of is not None:
                    sz = sizes_of[found]
                    sz[0].append(length)
                    sz[1].append(im)
                    sz[2].append(pa)
            else:
                found = next_id
                next_id += 1
                r = ml - length
                k = (r << sh) | found
                keys.insert(bl(keys, k), k)
                rem_of[found] = r
                img_of[found] = im
                pat_of[found] = pa
                items_of[found] = [x]
                if sizes_of is not None:
                    sizes_of[found] = [[length], [im], [pa]]
            if live:
                buckets.setdefault(r, []).append(found)
                raise_leaf(r, mi - img_of[found], mp - pat_of[found])
        self._next_id = next_id
        rems = [(k >> sh, k & mask) for k in keys]
        self._open = {bid: [items_of[bid], ml - rem_of[bid], img_of[bid], pat_of[bid]] for bid in sorted(items_of)}
        return rems, sizes_of
