"""`python tests/gcs_emulator_server.py PORT BUCKET`: gcp-storage-emulator, in memory, with one gap filled.

Its media downloads carry no `x-goog-generation` header, which real GCS always sends and TensorStore needs
for every read-modify-write (Orbax's OCDBT manifests: 'Malformed StorageGeneration' without it). This
script adds the header, and answers a download whose `ifGenerationNotMatch` is the object's generation
with 304, as GCS does. The emulator does not enforce write preconditions (`ifGenerationMatch`): the tests'
writers never race on one object."""

from __future__ import annotations

import sys
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        obj = None
    if obj is not None:
        generation = str(obj["generation"])
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        if request.query.get("ifGenerationNotMatch", [None])[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return
    _download(request, response, storage, *args, **kwargs)


objects.download = _download_with_generation  # before the server module builds its routes from it

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    port, bucket = sys.argv[1], sys.argv[2]
    main(["start", "--host", "127.0.0.1", "--port", port, "--in-memory", "--default-bucket", bucket])
