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
    repack_windows: int
    repack_budget: int | None
    _media: bool
    _open: dict[int, list[Any]]
    _carried: dict[int, int]
    _repack: dict[int, list[Any]]
    _num_windows: int
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

    def _finish_window(
        self,
        rems: list[tuple[int, int]] | None,
        final: bool,
        per_item: dict[int, Any] | None = None,
        born_of: dict[int, int] | None = None,
    ) -> list[list[int]]:
        """Closes the full bins (all bins if `final`) and returns them in creation order.

        Args:
            rems: `(remaining tokens, bin_id)` for every open bin, sorted; only used without media
                budgets (then "fullest" simply means least token room).
            per_item: `"bfd"` with re-planning: bin_id -> the tokens (with media budgets
                `[tokens, images, patches]`) of the samples placed in each bin during this window
                (complete for the bins created in it); `None`: no bin is re-planned.
            born_of: window each re-planned sample was first planned in (others: this window).
        """
        if final:
            return self._close(list(self._open))
        too_old: set[int] | None = None
        if per_item is not None and self.repack_windows > 0:
            # Samples already re-planned `repack_windows` times: a bin holding one is not re-planned.
            oldest = self._num_windows + 1 - self.repack_windows
            too_old = {x for x, born in born_of.items() if born < oldest} if born_of else set()
        if not self._media:
            assert rems is not None
            closing, young = self._select_closing(rems, too_old)
        else:
            closing, young = self._select_closing_media(too_old)
        packs = self._close(closing)
        if young:
            assert per_item is not None
            # The kept young bins, in creation order, with the window their oldest sample came in.
            w = self._num_windows
            get = born_of.get if born_of else None
            repack: dict[int, list[Any]] = {}
            for bid in sorted(young):
                born = w if get is None else min([get(x, w) for x in self._open[bid][0]])
                sizes = per_item[bid]
                repack[bid] = [*sizes, born] if self._media else [sizes, [], [], born]
            self._repack = repack
        return packs

    def _is_young(self, items: list[int], too_old: set[int] | None) -> bool:
        return too_old is not None and (not too_old or too_old.isdisjoint(items))

    def _over_budget(self, young: list[int], key: Any) -> list[int]:
        """Splits off the young bins beyond `repack_budget` samples (in place); returns them.

        Keeps the emptiest young bins (they gain most from being recombined). The others become
        frozen bins (or are closed by the caller when nothing fits them any more).
        """
        budget = self.repack_budget
        open_bins = self._open
        if budget is None or sum([len(open_bins[b][0]) for b in young]) <= budget:
            return []
        young.sort(key=key)
        for k, bid in enumerate(young):
            budget -= len(open_bins[bid][0])
            if budget < 0:
                over = young[k:]
                del young[k:]
                return over
        return []

    def _select_closing(self, rems: list[tuple[int, int]], too_old: set[int] | None) -> tuple[list[int], list[int]]:
        """Closing rule without media budgets; returns the bins to close and the young bins to keep.

        A bin whose token room is `<=` `close_threshold` is closed. A bin created in this window
        whose samples may still be re-planned (see `repack_windows`) is young: it is kept so that
        the next window re-plans its samples. Any other bin is closed when its room is below the
        shortest sample seen (nothing fits any more) or when it was carried over and received
        nothing during this window. Over `max_open_bins`, the fullest kept bins are closed; over
        `repack_budget` samples in young bins, the fullest young bins are frozen (closed when
        nothing fits them).
        """
        thr = self._threshold()
        ncut = bisect_right(rems, (thr if too_old is None else self.close_threshold, _MASK + 1))
        carried, open_bins = self._carried, self._open
        closing = [bid for _, bid in rems[:ncut]]
        rest: list[int] = []
        young: list[int] = []
        for r, bid in rems[ncut:]:
            if bid in carried:
                if r <= thr or carried[bid] == len(open_bins[bid][0]):
                    closing.append(bid)
                    continue
            elif self._is_young(open_bins[bid][0], too_old):
                young.append(bid)
            elif r <= thr:
                closing.append(bid)
                continue
            rest.append(bid)
        if self.max_open_bins is not None and len(rest) > self.max_open_bins:
            over = rest[: len(rest) - self.max_open_bins]
            closing.extend(over)
            if young:
                gone = set(over)
                young = [bid for bid in young if bid not in gone]
        if young:
            ml = self.max_length
            for bid in self._over_budget(young, lambda b: (open_bins[b][1], b)):
                if ml - open_bins[bid][1] <= thr:
                    closing.append(bid)
        return closing, young

    def _select_closing_media(self, too_old: set[int] | None) -> tuple[list[int], list[int]]:
        """Closing rule with media budgets; returns the bins to close and the young bins to keep.

        A bin created in this window whose samples may still be re-planned, whose fullest budget is
        tokens (used fraction) and that can still take a media-bearing sample (see below) is young:
        kept for re-planning unless its token room is `<=` `close_threshold`. With budgets that never
        bind this is exactly the token-only rule. Any other bin is closed when it was carried over and received
        nothing during this window, when its token room is within the threshold, or when it can no
        longer take any media-bearing sample (image room below the fewest images, or patch room
        within 0.5% of `max_vision_patches` / below the fewest patches, seen on a media sample).
        Such a bin could still take text-only samples, but waiting for them would keep it open
        indefinitely. Over `max_open_bins`, the fullest bins (largest used fraction of any budget)
        are closed first; over `repack_budget`, the fullest young bins are frozen (as above).
        """
        ml = self.max_length
        ct = self.close_threshold
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
        young: list[int] = []

        def media_stuck(im: int, pa: int) -> bool:
            return (mi is not None and mi - im <= img_thr) or (mp is not None and mp - pa <= pat_thr)

        def tokens_bind(tok: int, im: int, pa: int) -> bool:
            # Tokens are the fullest budget (a token-less bin counts as holding one token) and the
            # bin can still take a media-bearing sample. Re-planning helps when tokens limit a bin;
            # when images/patches do, token-tightest re-planning was measured to cost packs.
            t = tok if tok > 0 else 1
            return (
                (mi is None or im * ml <= t * mi)
                and (mp is None or pa * ml <= t * mp)
                and not media_stuck(im, pa)
            )

        def stuck(tok: int, im: int, pa: int) -> bool:
            return ml - tok <= tok_thr or media_stuck(im, pa)

        for bid, (items, tok, im, pa) in self._open.items():
            if bid not in carried and tokens_bind(tok, im, pa) and self._is_young(items, too_old):
                if ml - tok <= ct:
                    closing.append(bid)
                    continue
                young.append(bid)
            elif carried.get(bid) == len(items) or stuck(tok, im, pa):
                closing.append(bid)
                continue
            full = tok / ml
            if mi:
                full = max(full, im / mi)
            if mp:
                full = max(full, pa / mp)
            keep.append((-full, bid))
        if self.max_open_bins is not None and len(keep) > self.max_open_bins:
            keep.sort()
            over = [bid for _, bid in keep[: len(keep) - self.max_open_bins]]
            closing.extend(over)
            if young:
                gone = set(over)
                young = [bid for bid in young if bid not in gone]
        if young:
            full_of = {bid: -f for f, bid in keep}
            open_bins = self._open
            for bid in self._over_budget(young, lambda b: (full_of[b], b)):
                _, tok, im, pa = open_bins[bid]
                if stuck(tok, im, pa):
                    closing.append(bid)
        return closing, young
