"""End-of-window closing rules: which open packs are full and leave the planner.

Mixed into [`~hf_packing.planner.StreamingPlanner`]; works on its settings and open-bin state.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from .bfd import _MASK


class _ClosingRules:
    """Closes full packs at the end of a window (all of them on `flush`)."""

    max_length: int
    max_images: int | None
    max_vision_patches: int | None
    max_open_bins: int | None
    close_threshold: int
    _media: bool
    _open: dict[int, list[Any]]
    _carried: dict[int, int]
    _min_len: int | None
    _min_media_img: int | None
    _min_media_pat: int | None

    def _threshold(self) -> int:
        thr = self.close_threshold
        if self._min_len is not None:
            thr = max(thr, self._min_len - 1)
        return thr

    def _close(self, closed_ids: list[int]) -> list[list[int]]:
        closed_ids.sort()
        return [self._open.pop(bid)[0] for bid in closed_ids]

    def _finish_window(self, rems: list[tuple[int, int]] | None, final: bool) -> list[list[int]]:
        """Closes the full bins (all bins if `final`) and returns them in creation order.

        Args:
            rems: `(remaining tokens, bin_id)` for every open bin, sorted; only used without media
                budgets (then "fullest" simply means least token room).
        """
        if final:
            return self._close(list(self._open))
        if not self._media:
            assert rems is not None
            return self._close(self._select_closing(rems))
        return self._close(self._select_closing_media())

    def _select_closing(self, rems: list[tuple[int, int]]) -> list[int]:
        """Closing rule without media budgets.

        Closes bins whose token room is `<=` the threshold (a prefix of `rems`) and carried-over bins
        that received nothing during this window; then, over `max_open_bins`, the fullest.
        """
        thr = self._threshold()
        ncut = bisect_right(rems, (thr, _MASK + 1))
        carried, open_bins = self._carried, self._open
        rest = [bid for _, bid in rems[ncut:]]
        closing = [bid for _, bid in rems[:ncut]]
        if carried:
            closing.extend(bid for bid in rest if carried.get(bid) == len(open_bins[bid][0]))
            rest = [bid for bid in rest if carried.get(bid) != len(open_bins[bid][0])]
        if self.max_open_bins is not None and len(rest) > self.max_open_bins:
            closing.extend(rest[: len(rest) - self.max_open_bins])
        return closing

    def _select_closing_media(self) -> list[int]:
        """Closing rule with media budgets.

        A bin is closed when it was carried over and received nothing during this window, when
        its token room is within the threshold, or when it can no longer take
        any media-bearing sample (image room below the fewest images, or patch room within 0.5% of
        `max_vision_patches` / below the fewest patches, seen on a media sample). Such a bin could
        still take text-only samples, but waiting for them would keep it open indefinitely. Over
        `max_open_bins`, the fullest bins (largest used fraction of any budget) are closed first.
        """
        ml = self.max_length
        tok_thr = self._threshold()
        mi, mp = self.max_images, self.max_vision_patches
        img_thr = pat_thr = -1
        if mi is not None and self._min_media_img is not None:
            img_thr = self._min_media_img - 1
        if mp is not None and self._min_media_pat is not None:
            pat_thr = max(mp // 200, self._min_media_pat - 1)
        carried = self._carried
        closing: list[int] = []
        keep: list[tuple[float, int]] = []
        for bid, (items, tok, im, pa) in self._open.items():
            if (
                carried.get(bid) == len(items)
                or ml - tok <= tok_thr
                or (mi is not None and mi - im <= img_thr)
                or (mp is not None and mp - pa <= pat_thr)
            ):
                closing.append(bid)
            else:
                full = tok / ml
                if mi:
                    full = max(full, im / mi)
                if mp:
                    full = max(full, pa / mp)
                keep.append((-full, bid))
        if self.max_open_bins is not None and len(keep) > self.max_open_bins:
            keep.sort()
            closing.extend(bid for _, bid in keep[: len(keep) - self.max_open_bins])
        return closing
