"""`ShareStream` / `MessageMap` (thinwire.wire.shares): several tensors' runs of w-bit values
packed at once land at their places byte for byte as `pack_bits` of each run alone writes
them (shares that end mid-byte included), and W messages read back every share's values."""

import pytest
import torch

from thinwire.wire import pack_bits, packed_nbytes
from thinwire.wire.shares import MessageMap, ShareStream


@pytest.mark.parametrize("bits, counts", [(6, [2, 6, 8, 1]), (12, [128, 384]), (2, [3, 5, 4, 9]), (1, [7, 16, 1])])
def test_shares_land_as_each_packed_alone_and_read_back(bits, counts):
    gen = torch.Generator().manual_seed(bits)
    values = [torch.randint(0, 2 ** bits, (n,), generator=gen) for n in counts]
    sizes = [packed_nbytes(n, bits) for n in counts]
    places = [5 + sum(sizes[:j]) + 2 * j for j in range(len(counts))]            # after the raw run, gaps between
    nbytes = places[-1] + sizes[-1] + 5
    flags = bits == 1
    stream = ShareStream(counts, bits, flags, places, "cpu")
    message_map = MessageMap([(4, [0, nbytes - 4])], [stream], nbytes, "cpu")
    messages = torch.zeros(2, nbytes, dtype=torch.uint8)
    for r in range(2):
        shift = [(v + r) % 2 ** bits for v in values]
        message_map.raw_out(0, 8).copy_(torch.arange(8, dtype=torch.uint8) + r)
        flat = torch.cat(shift)
        stream.pack(flat.bool() if flags else flat, message_map.stream_out(0))
        message_map.write(messages[r])
        for v, place, size in zip(shift, places, sizes):
            assert torch.equal(messages[r, place: place + size], pack_bits(v, bits))
        assert torch.equal(messages[r, :4], torch.arange(4, dtype=torch.uint8) + r)
    got = message_map.read(messages)
    raw = got[: 2 * 8].view(2, 8)
    assert torch.equal(raw, torch.stack([torch.arange(8, dtype=torch.uint8) + r for r in range(2)]))
    back = stream.unpack(got[2 * 8:], 2)
    for r in range(2):
        want = torch.cat([(v + r) % 2 ** bits for v in values])
        assert torch.equal(back[r].long(), want)
