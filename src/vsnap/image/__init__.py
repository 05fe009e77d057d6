"""The image: its format and the one object that opens it.

    manifest   manifest.json: its record and its reader (format version first)
    store      staging, digests, publish by rename, the capture and readers' locks, verification
    local      `vsnap images` and `vsnap rm`: the images under the image roots
    origin     where a pulled image came from
    compat     the image against this host: every recorded fact that differs, dependency files
    handle     open_image(path): a trust-checked, read-locked image with its manifest read once

Imports vsnap.protocol and vsnap.host.
"""
