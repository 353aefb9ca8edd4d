"""Layout decisions the torch ops take from the neutral core (pure Python, numpy as the
reference): the permutation each transposing view means, the spellings of sizes, this rank's
slice of a whole tensor, which ranks keep a constant filled into a Partial tensor, and the
refusal to write values into a pending reduction."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from hyperpar.dtensor.api_core import inferred_uneven_message, uneven_lengths
from hyperpar.dtensor.layout import input_layout_problem, partial_fill_identity, shard_slices
from hyperpar.dtensor.placement import Partial, Replicate, Shard
from hyperpar.dtensor.rules.base import ShardingError, refuse_partial, spelled_dims, unshard
from hyperpar.dtensor.rules.view import (
    matrix_transposed_dims,
    moved_dims,
    permuted_dims,
    transposed_dims,
)

A = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)


def test_transposing_views_permute_as_numpy_does():
    for d0, d1 in [(0, 1), (1, 3), (-1, 0), (2, 2)]:
        assert np.array_equal(A.transpose(transposed_dims(4, d0, d1)), np.swapaxes(A, d0, d1))
    assert np.array_equal(A.transpose(permuted_dims(4, (3, -3, 0, 2))), A.transpose(3, 1, 0, 2))
    for src, dst in [(0, -1), ((0, 1), (3, 2)), ([3], [0]), ((), ())]:
        assert np.array_equal(A.transpose(moved_dims(4, src, dst)), np.moveaxis(A, src, dst))
    assert np.array_equal(A.transpose(matrix_transposed_dims(4, False)), A.T)
    assert np.array_equal(A.transpose(matrix_transposed_dims(4, True)), np.swapaxes(A, -1, -2))
    assert matrix_transposed_dims(1, False) == (0,) and matrix_transposed_dims(0, True) == ()
    assert transposed_dims(0, 0, -1) == ()  # a 0-d tensor takes dims 0 and -1, as in torch


def test_transposing_views_refuse_dims_out_of_range_instead_of_wrapping():
    for bad in (lambda: transposed_dims(2, 0, 5), lambda: permuted_dims(2, (1, 2)),
                lambda: moved_dims(3, 3, 0), lambda: transposed_dims(0, 1, 0)):
        with pytest.raises(IndexError, match="Dimension out of range"):
            bad()
    with pytest.raises(RuntimeError, match=r"movedim: source \[0, 1\] and destination \[2\]"):
        moved_dims(3, (0, 1), 2)
    with pytest.raises(RuntimeError, match="each once"):
        moved_dims(3, (0, 0), (1, 2))


def test_sizes_are_read_inline_or_as_one_sequence():
    assert spelled_dims((1, 0)) == spelled_dims(((1, 0),)) == spelled_dims(([1, 0],)) == (1, 0)
    assert spelled_dims((4,)) == (4,) and spelled_dims(()) == ()


def _mesh(shape, coord):
    return SimpleNamespace(_shape=shape, _coordinate=coord)


def test_shard_slices_cut_torch_chunk_pieces_that_tile_the_whole_tensor():
    full = np.arange(5 * 7).reshape(5, 7)
    placements = (Shard(0), Shard(1))  # 5 rows over 2 ranks (3, 2), 7 cols over 3 (3, 3, 1)
    rows = [np.concatenate([full[shard_slices(full.shape, placements, _mesh((2, 3), (i, j)))]
                            for j in range(3)], axis=1) for i in range(2)]
    assert np.array_equal(np.concatenate(rows, axis=0), full)
    assert full[shard_slices(full.shape, placements, _mesh((2, 3), (1, 2)))].shape == (2, 1)
    nested = [full[shard_slices(full.shape, (Shard(1), Shard(1)), _mesh((2, 2), (i, j)))]
              for i in range(2) for j in range(2)]  # mesh dim 0 takes the outer chunk
    assert [p.shape[1] for p in nested] == [2, 2, 2, 1]
    assert np.array_equal(np.concatenate(nested, axis=1), full)
    assert full[shard_slices(full.shape, (Replicate(),), _mesh((4,), (3,)))].shape == (5, 7)
    # a rank outside the mesh holds an empty piece
    assert full[shard_slices(full.shape, (Shard(0),), _mesh((2,), None))].size == 0


def test_a_constant_filled_into_a_partial_sum_or_product_counts_once():
    mesh_shape = (2, 3)
    coords = [(i, j) for i in range(mesh_shape[0]) for j in range(mesh_shape[1])]
    reduce = {"sum": sum, "product": math.prod}
    for op in ("sum", "product"):
        for placements in [(Partial(op), Replicate()), (Shard(0), Partial(op)),
                           (Partial(op), Partial(op))]:
            held = {c: 7.0 if (i := partial_fill_identity(placements, c)) is None else i
                    for c in coords}
            # the value each pending reduction yields: its op over the ranks it spans
            partial_dims = [m for m, p in enumerate(placements) if type(p) is Partial]
            for c in coords:
                group = [held[o] for o in coords
                         if all(o[m] == c[m] for m in range(2) if m not in partial_dims)]
                assert reduce[op](group) == 7.0, (op, placements, c)
    for op in ("max", "min", "avg"):  # these reduce equal terms to the value itself
        assert partial_fill_identity((Partial(op),), (1,)) is None
    assert partial_fill_identity((Shard(0), Replicate()), (1, 2)) is None
    with pytest.raises(ValueError, match="a pending sum on one mesh dim and a pending product"):
        partial_fill_identity((Partial("sum"), Partial("product")), (0, 0))


def test_writing_values_into_a_pending_reduction_is_refused_naming_the_fix():
    refuse_partial((Shard(0), Replicate()), "fill_")
    with pytest.raises(ShardingError, match=r"^uniform_ on a Partial DTensor; redistribute it "
                                            r"to Replicate or Shard first$"):
        refuse_partial((Shard(0), Partial("max")), "uniform_")


def test_a_styles_plain_inputs_are_checked_against_its_layout():
    ranks = [4, 5, 6]  # the mesh's global ranks, named in the messages
    ok = input_layout_problem(Shard(1), [(2, 3, 8), (2, 3, 8), (2, 2, 8)], ranks, [5, 6], True,
                              "w")
    assert ok is None  # 8 of 3 + 3 + 2, torch.chunk's split
    assert input_layout_problem(Replicate(), [(2, 3)] * 3, ranks, [], True, "w") is None
    assert input_layout_problem(Partial(), [(2, 3)] * 3, ranks, [5], True, "w") is None
    got = input_layout_problem(Replicate(), [(2, 3), (2, 3), (4, 3)], ranks, [6], True, "'a'")
    assert got.startswith("'a': the input must be replicated") and "rank(s) 6 hold" in got
    assert "shapes rank 4: (2, 3), rank 5: (2, 3), rank 6: (4, 3)" in got
    assert "different values" in input_layout_problem(Replicate(), [(2, 3)] * 3, ranks, [5],
                                                      True, "w")
    uneven = input_layout_problem(Shard(-1), [(2, 2), (2, 3), (2, 3)], ranks, [5, 6], True, "w")
    assert "lengths [3, 3, 2] along dim 1 for a total of 8" in uneven
    assert "x.tensor_split(3, dim=1)[rank]" in uneven
    others = input_layout_problem(Shard(0), [(3, 2), (3, 3), (2, 2)], ranks, [5, 6], True, "w")
    assert others is not None and "the ranks hold shapes" in others
    whole = input_layout_problem(Shard(0), [(3, 2)] * 3, ranks, [], True, "w")
    assert "every rank holds the same values" in whole and "9, 3 times the real one" in whole
    # identical constant pieces (a mask of ones, say) are legitimate
    assert input_layout_problem(Shard(0), [(3, 2)] * 3, ranks, [], False, "w") is None


def test_unshard_gathers_the_named_dims_and_pending_reductions_only():
    pl = (Shard(0), Shard(1), Partial("max"), Replicate())
    assert unshard(pl) == (Shard(0), Shard(1), Replicate(), Replicate())
    assert unshard(pl, (1,)) == (Shard(0), Replicate(), Replicate(), Replicate())
    assert unshard(pl, range(2), partial_ok=True) == (Replicate(), Replicate(), Partial("max"),
                                                      Replicate())


def test_uneven_pieces_of_an_inferred_shape_are_named_rank_by_rank():
    assert uneven_lengths(Shard(0), 0, [0, 1], [3, 3]) is None
    found = uneven_lengths(Shard(1), 1, [2, 3], [3, 2])
    assert found == "Shard(dim=1) over mesh dim 1: rank 2 holds 3, rank 3 holds 2"
    text = inferred_uneven_message("from_local", [found], "Pass shape=")
    assert text.startswith(f"from_local: the ranks hold pieces of different sizes ({found})")
    assert text.endswith("every rank has a different (wrong) one. Pass shape=")
    assert "(in another group of the mesh)" in inferred_uneven_message("x", [], "fix")
