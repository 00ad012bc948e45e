"""Where each of a list of parts lies in one flat buffer (`Span`, `spans`, `views`,
`same_place`), and the flat buffers kept across steps (`reuse`): they live in
`thinwire.wire.spans`, below `compress/` (whose layout-level compressors use them too), and are
imported here for the optimizers."""

from ..wire.spans import Span, reuse, same_place, spans, views

__all__ = ["Span", "reuse", "same_place", "spans", "views"]
