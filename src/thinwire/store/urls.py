"""A store location from its URL (`open_location`): one module above both kinds, so the
optional S3 client is imported only when an s3:// URL is opened and no location module
imports another's."""

from __future__ import annotations

from urllib.parse import urlparse

from .locations import SCHEMES, FileLocation, Location


def open_location(url: str, **options) -> Location:
    """The location a URL names, checked: `file:///abs/dir` or `s3://bucket/prefix`.

    `options` go to the S3 client (endpoint, region, access_key_id, secret_access_key, ...;
    AWS_* environment variables are read too); a file:// location takes none.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/") or options:
            raise ValueError(f"invalid file location {url!r}: use file:///absolute/folder, with no options")
        location: Location = FileLocation(parsed.path)
    elif parsed.scheme == "s3":
        from .s3 import S3Location          # needs the optional S3 client, so imported only here
        if not parsed.netloc:
            raise ValueError(f"invalid s3 location {url!r}: use s3://bucket/prefix")
        location = S3Location(parsed.netloc, parsed.path.strip("/"), **options)
    else:
        raise ValueError(f"unsupported location scheme {parsed.scheme!r} in {url!r}: "
                         f"thinwire's store exchange supports {', '.join(s + '://' for s in SCHEMES)}")
    location.check()
    return location
