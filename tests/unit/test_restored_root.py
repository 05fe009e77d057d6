"""The restored tree's PID comes from CRIU's pidfile; vsnap acts on it only once it proves to be
the tree: its own child (the subreaper the detached tree is handed to) and PID 1 of a PID
namespace of its own (hostile pass 10: the pidfile sat in the tree's control directory, where the
restored tree could write any host PID, which a failure or `vsnap stop` then SIGKILLed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from vsnap.host import proctree as _proctree
from vsnap.host.proctree import identify_restored_root, in_tree_namespace, namespace_pids

# A child that hands a PID namespace's first process to this process, as `criu restore
# --restore-detached` does: `unshare --pid --fork` is killed, its child is reparented to us.
PROBE = r"""
import json, os, signal, subprocess, sys, time
sys.path[:0] = [os.environ["SRC"]]
from vsnap.host.proctree import become_subreaper, identify_restored_root, in_tree_namespace, identify, namespace_pids, our_children
become_subreaper()
before_launch = our_children()
launcher = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"])
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    children = [int(c) for c in open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()]
    if children and namespace_pids(children[0])[1:] == [1]:
        break
    time.sleep(0.01)
init = children[0]
before = identify_restored_root(init, before_launch)  # unshare's child, not ours yet
os.kill(launcher.pid, signal.SIGKILL)
launcher.wait()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and open(f"/proc/{init}/stat").read().rsplit(")", 1)[1].split()[1] != str(os.getpid()):
    time.sleep(0.01)
after = identify_restored_root(init, before_launch)
old_child = identify_restored_root(init, our_children())  # ours already before: not this restore's
bystander = subprocess.Popen(["sleep", "60"])  # our child, but no namespace's first process
print(json.dumps({"before": before is not None, "after": after is not None and after == identify(init),
                  "old_child": old_child is not None,
                  "bystander": identify_restored_root(bystander.pid, set()) is not None,
                  "pid1": identify_restored_root(1, set()) is not None,
                  "ns_of_init": after is not None and in_tree_namespace(init, after),
                  "ns_of_self": after is not None and in_tree_namespace(os.getpid(), after)}))
bystander.kill(); os.kill(init, signal.SIGKILL); os.waitpid(init, 0); bystander.wait()
"""


def test_only_our_child_that_is_a_namespaces_first_process_is_the_tree() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("makes a PID namespace: needs root and unshare")
    src = os.path.dirname(os.path.dirname(_proctree.__file__))
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SRC": src})
    assert out.returncode == 0, out.stderr
    import json

    assert json.loads(out.stdout) == {"before": False, "after": True, "old_child": False, "bystander": False,
                                      "pid1": False, "ns_of_init": True, "ns_of_self": False}


def test_namespace_pids_of_a_process_outside_any_inner_namespace() -> None:
    assert namespace_pids(os.getpid())[0] == os.getpid()  # as /proc's namespace sees it: the outermost first
    assert namespace_pids(2**22 + 12345) == []  # no such process
    assert identify_restored_root(2**22 + 12345, set()) is None
    assert not in_tree_namespace(os.getpid(), _proctree.ProcessIdentity(2**22 + 12345, 1, "x"))
