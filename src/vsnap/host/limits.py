"""This process's descriptor limit, raised before it launches a tree or runs CRIU.

A tree is launched with what vsnap has, and CRIU restores a tree's limits as captured, so an
image captured under `ulimit -n 64` would keep 64 in every restore (a hundred idle clients would
use up its server's descriptors); CRIU itself needs room too (with a soft limit of 64 its restore
fails choosing its service descriptors). Raising the hard limit takes CAP_SYS_RESOURCE; without
it the soft limit goes up to the hard one.
"""

from __future__ import annotations

import resource

# The descriptor limit a tree is launched with, where the host allows it; what every restore of
# the image then has.
TREE_NOFILE = 65536
MAX_TREE_NOFILE = 1 << 20  # a hard limit of 2^30 (some hosts) would make fd-table walks slow


def raise_fd_limit(want: int = TREE_NOFILE) -> tuple[int, int]:
    """At least ``want`` where the host allows it, else the hard limit (at most MAX_TREE_NOFILE);
    never lowered. Returns the (soft, hard) limits now in force."""
    infinite = resource.RLIM_INFINITY  # never for RLIMIT_NOFILE on Linux, but never lowered either
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != infinite and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want, want
        except (OSError, ValueError):
            pass  # no CAP_SYS_RESOURCE (or fs.nr_open is lower): the hard limit stays
    ceiling = MAX_TREE_NOFILE if hard == infinite else min(hard, MAX_TREE_NOFILE)
    target = soft if soft == infinite else max(soft, ceiling)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target, hard
