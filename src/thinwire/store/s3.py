"""S3-API buckets (AWS S3, Cloudflare R2, MinIO, GCS's XML API) through obstore.

obstore (Python bindings to the Rust `object_store` crate that Arrow, DataFusion and Polars
use) is imported only when an s3:// location is opened: it is the optional extra
`thinwire[store]`, so the core install stays torch + numpy + matplotlib. Why obstore and
not boto3 or s3fs: docs/design.md, "The store exchange".

put_once is a PUT with `If-None-Match: *` (obstore's mode="create"): the store refuses it
with 412 when the key exists, atomically on AWS S3 (since August 2024), R2 and MinIO. On a
store that ignores the header the PUT would overwrite, and two sites could both believe they
closed a round: use only stores that honour it (docs/design.md lists what was tested).
"""

from __future__ import annotations

from .locations import Location, LocationError

INSTALL_HINT = "s3:// locations need the optional S3 client: pip install thinwire[store]"


def _obstore():
    """The obstore module, or ImportError saying how to install it."""
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return obstore


def _client_options(options: dict) -> dict:
    """obstore keyword arguments for `options`, with what a local or non-AWS endpoint needs:
    plain http allowed for an http:// endpoint, and path-style requests (bucket in the path,
    as MinIO and most S3-compatible servers expect) whenever an endpoint is given."""
    options = dict(options)
    endpoint = str(options.get("endpoint", ""))
    client = dict(options.pop("client_options", None) or {})
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)
    if endpoint:
        options.setdefault("virtual_hosted_style_request", False)
    return {**options, "client_options": client} if client else options


class S3Location(Location):
    """The objects under s3://bucket/prefix. `options` are obstore's S3 settings
    (endpoint, region, access_key_id, secret_access_key, session_token, ...); AWS_*
    environment variables fill in what is not given."""

    def __init__(self, bucket: str, prefix: str = "", **options) -> None:
        super().__init__()
        self._obs = _obstore()
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        store_options = _client_options(options)
        if prefix:
            store_options["prefix"] = prefix
        self._store = self._obs.store.S3Store(bucket, **store_options)

    def check(self) -> None:
        self._list("")      # a missing bucket or refused credentials fail here, not mid-round

    def _put_once(self, key: str, data: bytes) -> bool:
        errors = self._obs.exceptions
        try:
            self._obs.put(self._store, key, data, mode="create")
            return True
        except (errors.AlreadyExistsError, errors.PreconditionError, FileExistsError):
            return False
        except Exception as err:
            raise self._explain(err, f"put {key}") from err

    def _get(self, key: str) -> bytes | None:
        try:
            return bytes(self._obs.get(self._store, key).bytes())
        except Exception as err:
            if self._is_missing_key(err):
                return None
            raise self._explain(err, f"get {key}") from err

    def _list(self, folder: str) -> list[str]:
        try:
            return [meta["path"] for batch in self._obs.list(self._store, prefix=folder or None)
                    for meta in batch]
        except Exception as err:
            raise self._explain(err, f"list {folder or '/'}") from err

    def _is_missing_key(self, err: Exception) -> bool:
        # obstore raises FileNotFoundError (or its NotFoundError) for a missing key and for a
        # missing bucket alike; only S3's error code tells them apart.
        not_found = isinstance(err, (FileNotFoundError, self._obs.exceptions.NotFoundError))
        return not_found and "NoSuchBucket" not in str(err)

    def _explain(self, err: Exception, what: str) -> Exception:
        """A LocationError for what makes the location unusable; other errors unchanged."""
        errors = self._obs.exceptions
        if "NoSuchBucket" in str(err):
            return LocationError(f"{self.url}: no such bucket {self.bucket!r} ({what})")
        if isinstance(err, (errors.PermissionDeniedError, errors.UnauthenticatedError, PermissionError)):
            return LocationError(f"{self.url}: the store refused this site's credentials ({what}): {err}")
        return err
