"""Shared by the launcher stand-ins in this folder (torchrun, accelerate, srun, sbatch, ray).

They stand in for the real launchers where those are not installed (CI without PyTorch, Ray or
Slurm), for scripts/test-launchers.sh. Each does what its launcher does with the ENVIRONMENT of
the processes it starts, and nothing else: no rendezvous, no process groups, no scheduling, no
GPUs. Every one of them says "stand-in" on stderr, so a log never passes one off as the real
launcher. What each real launcher does is written next to the code that imitates it.
"""

import os
import shutil
import subprocess
import sys


def note(name, msg):
    sys.stderr.write(f"[{name} stand-in] {msg}\n")
    sys.stderr.flush()


def split_options(argv, flags, name):
    """Options before the first operand: {option: value} (flags map to True), and the rest.
    Accepts --opt=value, --opt value, and for short options -n 2 / -n2."""
    opts, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if "=" in a and a.startswith("--"):
            k, v = a.split("=", 1)
            opts[k] = v
        elif a in flags:
            opts[a] = True
        elif a.startswith("--"):
            if i + 1 >= len(argv):
                note(name, f"option {a} needs a value")
                sys.exit(2)
            opts[a] = argv[i + 1]
            i += 1
        elif len(a) > 2:  # -n2
            opts[a[:2]] = a[2:]
        else:
            if i + 1 >= len(argv):
                note(name, f"option {a} needs a value")
                sys.exit(2)
            opts[a] = argv[i + 1]
            i += 1
        i += 1
    return opts, argv[i:]


def get(opts, *names, default=None):
    """The value of the first of names present (a launcher's spellings of one option)."""
    for n in names:
        if n in opts:
            return opts[n]
    return default


def spawn_all(commands, name):
    """Start every (argv, env) at once, wait for all; the first non-zero exit status, else 0."""
    procs = []
    for argv, env in commands:
        exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
        if exe is None:
            note(name, f"{argv[0]}: command not found")
            return 127
        procs.append(subprocess.Popen([exe] + argv[1:], env=env))
    rc = 0
    for p in procs:
        r = p.wait()
        if r != 0 and rc == 0:
            rc = r if r > 0 else 128 - r
    return rc
