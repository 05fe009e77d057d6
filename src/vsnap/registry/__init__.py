"""Images in an OCI registry: ``oci`` (references, layout, what a pull accepts; no I/O), ``client``
(the seam over oras-py), ``blobio`` (bytes in and out of blobs), ``pushed`` (what this host already
made), ``push`` and ``pull`` (the two use cases). Imports protocol, host and image."""
