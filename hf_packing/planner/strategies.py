"""Per-window packing for `"next_fit"`, `"ffd"` and `"balanced"`, and helpers all strategies share.

`"bfd"` lives in `bfd.py`. Mixed into [`~hf_packing.planner.StreamingPlanner`]; works on its settings
and open-bin state.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np


class _WindowStrategies:
    """Plans one window of samples against the open packs (`"next_fit"`, `"ffd"`, `"balanced"`)."""

    max_length: int
    max_images: int | None
    max_vision_patches: int | None
    _open: dict[int, list[Any]]
    _next_id: int

    def _sorted_window(
        self, idx: list[int], lens: list[int], imgs: list[int] | None, pats: list[int] | None
    ) -> tuple[list[int], list[int], list[int] | None, list[int] | None]:
        """Longest first; ties keep arrival order (stable sort)."""
        if not lens:
            return [], [], ([] if imgs is not None else None), ([] if pats is not None else None)
        la = np.asarray(lens, dtype=np.int64)
        order = np.argsort(-la, kind="stable")
        s_len = la[order].tolist()
        s_idx = np.asarray(idx, dtype=np.int64)[order].tolist()
        s_img = np.asarray(imgs, dtype=np.int64)[order].tolist() if imgs is not None else None
        s_pat = np.asarray(pats, dtype=np.int64)[order].tolist() if pats is not None else None
        return s_idx, s_len, s_img, s_pat

    def _media_limits(self) -> tuple[int, int]:
        big = 1 << 62
        mi = self.max_images if self.max_images is not None else big
        mp = self.max_vision_patches if self.max_vision_patches is not None else big
        return mi, mp

    # next_fit ---------------------------------------------------------------
    def _window_next_fit(
        self, idx: list[int], lens: list[int], imgs: list[int] | None, pats: list[int] | None, final: bool
    ) -> list[list[int]]:
        ml = self.max_length
        mi, mp = self._media_limits()
        packs: list[list[int]] = []
        cur_id: int | None = None
        if self._open:
            (cur_id, cur), = self._open.items()
            items, tok, im, pa = cur
        else:
            items, tok, im, pa = [], 0, 0, 0
        next_id = self._next_id
        for j, length in enumerate(lens):
            i_j = imgs[j] if imgs is not None else 0
            p_j = pats[j] if pats is not None else 0
            if cur_id is not None and tok + length <= ml and im + i_j <= mi and pa + p_j <= mp:
                items.append(idx[j])
                tok += length
                im += i_j
                pa += p_j
                continue
            if cur_id is not None:
                packs.append(items)
                self._open.pop(cur_id, None)
            cur_id = next_id
            next_id += 1
            items, tok, im, pa = [idx[j]], length, i_j, p_j
        self._next_id = next_id
        self._open.clear()
        if cur_id is not None:
            if final:
                packs.append(items)
            else:
                self._open[cur_id] = [items, tok, im, pa]
        return packs

    # ffd --------------------------------------------------------------------
    def _window_ffd(
        self, idx: list[int], lens: list[int], imgs: list[int] | None, pats: list[int] | None, final: bool
    ) -> list[list[int]]:
        """First fit over open bins in creation order, via a max segment tree over bin slots."""
        ml = self.max_length
        mi, mp = self._media_limits()
        open_bins = self._open
        slot_bid: list[int] = list(open_bins)  # creation order
        slot_items: list[list[int]] = [b[0] for b in open_bins.values()]
        slot_img: list[int] = [b[2] for b in open_bins.values()]
        slot_pat: list[int] = [b[3] for b in open_bins.values()]
        s_idx, s_len, s_img, s_pat = self._sorted_window(idx, lens, imgs, pats)
        media = s_img is not None
        nslots = len(slot_bid) + len(s_len)
        size = 1
        while size < nslots:
            size <<= 1
        # tok: remaining token room; imx/pmx: remaining image/patch room (media budgets only).
        tok = [-1] * (2 * size)
        imx = [-1] * (2 * size) if media else tok
        pmx = [-1] * (2 * size) if media else tok
        for s, b in enumerate(open_bins.values()):
            tok[size + s] = ml - b[1]
            if media:
                imx[size + s] = mi - b[2]
                pmx[size + s] = mp - b[3]
        for i in range(size - 1, 0, -1):
            lo = 2 * i
            tok[i] = tok[lo] if tok[lo] >= tok[lo + 1] else tok[lo + 1]
            if media:
                imx[i] = imx[lo] if imx[lo] >= imx[lo + 1] else imx[lo + 1]
                pmx[i] = pmx[lo] if pmx[lo] >= pmx[lo + 1] else pmx[lo + 1]
        next_id = self._next_id
        for j, length in enumerate(s_len):
            x = s_idx[j]
            s = -1
            if not media:
                im = pa = 0
                if tok[1] >= length:
                    i = 1
                    while i < size:
                        i <<= 1
                        if tok[i] < length:
                            i += 1
                    s = i - size
            else:
                im = s_img[j]  # type: ignore[index]
                pa = s_pat[j]  # type: ignore[index]
                # Leftmost slot with room on all three budgets; backtracks past nodes whose maxima
                # come from different bins.
                i = 1
                while True:
                    if tok[i] >= length and imx[i] >= im and pmx[i] >= pa:
                        if i >= size:
                            s = i - size
                            break
                        i <<= 1
                        continue
                    while i & 1:
                        i >>= 1
                    if i == 0:
                        break
                    i += 1
            if s < 0:
                s = len(slot_bid)
                slot_bid.append(next_id)
                slot_items.append([x])
                slot_img.append(im)
                slot_pat.append(pa)
                next_id += 1
                rem = ml - length
            else:
                slot_items[s].append(x)
                slot_img[s] += im
                slot_pat[s] += pa
                rem = tok[size + s] - length
            i = size + s
            tok[i] = rem
            if media:
                imx[i] = mi - slot_img[s]
                pmx[i] = mp - slot_pat[s]
            i >>= 1
            while i:
                lo = 2 * i
                v = tok[lo] if tok[lo] >= tok[lo + 1] else tok[lo + 1]
                if media:
                    a = imx[lo] if imx[lo] >= imx[lo + 1] else imx[lo + 1]
                    c = pmx[lo] if pmx[lo] >= pmx[lo + 1] else pmx[lo + 1]
                    if tok[i] == v and imx[i] == a and pmx[i] == c:
                        break
                    imx[i] = a
                    pmx[i] = c
                elif tok[i] == v:
                    break
                tok[i] = v
                i >>= 1
        self._next_id = next_id
        new_open: dict[int, list[Any]] = {}
        rems: list[tuple[int, int]] = []
        for s, bid in enumerate(slot_bid):
            rem = tok[size + s]
            new_open[bid] = [slot_items[s], ml - rem, slot_img[s], slot_pat[s]]
            rems.append((rem, bid))
        self._open = new_open
        rems.sort()
        return self._finish_window(rems, final)

    # balanced ---------------------------------------------------------------
    def _window_balanced(
        self, idx: list[int], lens: list[int], imgs: list[int] | None, pats: list[int] | None
    ) -> list[list[int]]:
        if not lens:
            return []
        ml = self.max_length
        mi, mp = self._media_limits()
        s_idx, s_len, s_img, s_pat = self._sorted_window(idx, lens, imgs, pats)
        n = len(s_len)
        total = sum(s_len)
        k = max(1, -(-total // ml))
        if s_img is not None:
            assert s_pat is not None
            if self.max_images:
                k = max(k, -(-sum(s_img) // self.max_images))
            if self.max_vision_patches:
                k = max(k, -(-sum(s_pat) // self.max_vision_patches))
            media_img = [im for im, pa in zip(s_img, s_pat) if im or pa]
            media_pat = [pa for im, pa in zip(s_img, s_pat) if im or pa]
            min_im = min(media_img) if media_img else 0
            min_pa = min(media_pat) if media_pat else 0
        k = min(k, n)

        def attempt(nb: int) -> tuple[list[list[int]] | None, int]:
            """Greedy assignment into `nb` bins; returns (bins, max load) or (None, -1) if media-infeasible.

            Token room is not enforced during the pass: on tokens the least-loaded bin is the best
            candidate, so the pass is feasible exactly when its final max load is <= max_length.
            """
            bins: list[list[int]] = [[] for _ in range(nb)]
            if s_img is None:
                heap = [(0, b) for b in range(nb)]
                replace = heapq.heapreplace
                for x, length in zip(s_idx, s_len):
                    load, b = heap[0]
                    replace(heap, (load + length, b))
                    bins[b].append(x)
                return bins, max(load for load, _ in heap)
            # Two lazy heaps of (load, bin): every bin, and bins that can still take some media.
            # Entries whose load is out of date are skipped; bins with no media room are dropped
            # from the media heap for good.
            push, pop = heapq.heappush, heapq.heappop
            load = [0] * nb
            bimg = [0] * nb
            bpat = [0] * nb
            h_all = [(0, b) for b in range(nb)]
            h_med = list(h_all)
            for j, length in enumerate(s_len):
                im, pa = s_img[j], s_pat[j]  # type: ignore[index]
                if im == 0 and pa == 0:
                    while h_all[0][0] != load[h_all[0][1]]:
                        pop(h_all)
                    b = h_all[0][1]
                else:
                    b = -1
                    stash = []
                    while h_med:
                        entry = pop(h_med)
                        c = entry[1]
                        if entry[0] != load[c]:
                            continue
                        if bimg[c] + im <= mi and bpat[c] + pa <= mp:
                            b = c
                            break
                        if mi - bimg[c] >= min_im and mp - bpat[c] >= min_pa:
                            stash.append(entry)
                    for entry in stash:
                        push(h_med, entry)
                    if b < 0:
                        return None, -1
                bins[b].append(s_idx[j])
                load[b] += length
                bimg[b] += im
                bpat[b] += pa
                push(h_all, (load[b], b))
                if mi - bimg[b] >= min_im and mp - bpat[b] >= min_pa:
                    push(h_med, (load[b], b))
            return bins, max(load)

        # Infeasible k: the final spread (max load - mean load) barely depends on k, so jump to the k
        # whose mean leaves room for it; repeat (always at least +1) until feasible. k = n always works.
        while True:
            bins, max_load = attempt(k)
            if bins is not None and max_load <= ml:
                break
            assert k < n, "one sample per bin is always feasible"
            if bins is None:
                k_new = k + max(1, k // 4)
            else:
                room = ml - (max_load - total / k)
                k_new = math.ceil(total / room) if room > 0 else 2 * k
            k = min(n, max(k + 1, k_new))
        packs = [b for b in bins if b]
        self._next_id += len(packs)
        return packs
