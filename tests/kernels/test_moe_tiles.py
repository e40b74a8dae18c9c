"""The grouped MoE GEMM's tiles fit the GPU's shared memory at every element size (``kernels.moe.tiles_for``):
Triton raises OutOfResources at the first launch otherwise (a float32 Qwen3-MoE once did, on Hopper)."""

import pytest

pytest.importorskip("triton")

# opt-in shared memory a block may use: Hopper, A100, Ada (L40S, RTX 4090)
SHARED_BYTES = {"sm90": 232448, "sm80": 166912, "sm89": 101376}


def pipeline_bytes(tile, itemsize: int) -> int:
    """What Triton's pipeliner keeps in shared memory for the grouped GEMM (stages - 1 buffers of A and W): the
    formula ``fit_shared_memory`` uses, so this checks its search; hopper_compile.py (test_triton_interpreter.py)
    checks the formula itself against Triton's compiled sizes (it matched them to the byte: 196,608 at float32
    128 x 256 in 3 stages)."""
    w_tiles = 2 if tile.fuse_silu else 1
    return (tile.stages - 1) * (tile.block_m + w_tiles * tile.block_n) * tile.block_k * itemsize


@pytest.mark.parametrize("gpu", sorted(SHARED_BYTES))
@pytest.mark.parametrize("itemsize", [2, 4])
def test_every_tile_fits(gpu, itemsize):
    from tpserve.kernels.moe import TILES_BY_ROWS, tiles_for

    for bound, chosen in TILES_BY_ROWS:
        tile = tiles_for(bound or 1 << 20, itemsize=itemsize, shared_bytes=SHARED_BYTES[gpu])
        assert pipeline_bytes(tile, itemsize) <= SHARED_BYTES[gpu], (gpu, itemsize, tile)
        assert (tile.block_m, tile.block_k, tile.fuse_silu) == (chosen.block_m, chosen.block_k, chosen.fuse_silu)
        assert tile.stages >= 2 and tile.block_n >= 16


def test_bf16_on_hopper_keeps_the_measured_tiles():
    from tpserve.kernels.moe import TILES_BY_ROWS, tiles_for

    assert [tiles_for(bound or 1 << 20) for bound, _ in TILES_BY_ROWS] == [tile for _, tile in TILES_BY_ROWS]
    big = tiles_for(1 << 20, itemsize=4)
    assert (big.block_n, big.stages) == (256, 3)  # float32 on Hopper: a stage fewer, the same block
