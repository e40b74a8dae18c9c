import pytest
import torch

from tpserve.kvcache.pool import KVCachePool, PageAllocator


def test_allocator_accounting_and_order():
    alloc = PageAllocator(9)
    assert alloc.total == 8 and alloc.num_free == 8
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert a == [1, 2, 3] and b == [4, 5, 6, 7, 8]
    assert 0 not in a + b, "page 0 is the scratch page"
    assert alloc.num_free == 0 and alloc.num_used == 8
    with pytest.raises(MemoryError, match="asked for 1 KV pages, only 0 free"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3
    assert alloc.allocate(2) == [1, 2]
    alloc.free(b)
    assert alloc.num_free + alloc.num_used == alloc.total == 8


def test_allocator_needs_two_pages():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(1)


def test_store_writes_only_the_given_slots():
    pool = KVCachePool(2, 4, 3, 2, 4, torch.float32, torch.device("cpu"))
    k = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)
    v = -k
    slots = torch.tensor([4, 11])  # page 1 offset 1, page 3 offset 2
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k[1][1, 1], k[0]) and torch.equal(pool.k[1][3, 2], k[1])
    assert torch.equal(pool.v[1][3, 2], v[1])
    assert pool.k[0].abs().sum() == 0, "other layers untouched"
    assert pool.k[1].abs().sum() == k.abs().sum()
    assert KVCachePool.bytes_per_page(2, 3, 2, 4, torch.bfloat16) == 2 * 2 * 3 * 2 * 4 * 2
