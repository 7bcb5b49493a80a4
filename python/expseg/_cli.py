"""The commands a wheel puts on PATH, and ``python -m expseg``: each runs the tool installed
with the package (``_lib/``), with ``EXPSEG_LIB`` pointing at the installed library unless
the user set it. ``run``, ``srun``, ``report-merge`` and ``--lib`` are answered here; every
other command (``doctor``, ``pause``, ``resume``, ``paused``, ``glibc``, ``help CMD``) by the
installed ``expseg`` binary, which names what it cannot read in one line (exit status 2)."""

import os
import sys

from . import _LIB_DIR, __version__, library_path

USAGE = """usage: expseg COMMAND [ARGS...]        (or: python -m expseg COMMAND ...)

commands:
  run CMD...      run CMD, and every process it starts, under expseg (= expseg-run CMD)
  srun [SRUN OPTIONS] -- CMD...
                  srun with every task under expseg (= expseg-srun)
  doctor          can expseg work on this machine? one verdict per line
  pause PID...    pause the GPU memory of running expseg processes of yours
  resume PID...   bring paused memory back, at the same addresses
  paused PID...   how much memory is paused now
  report-merge DIR|FILE...
                  one table of many ranks' JSON reports (= expseg-report-merge)
  glibc FILE      the highest GLIBC_ version FILE requires
  help COMMAND    a command's help (the same as expseg COMMAND --help)

options:
  --lib           print the installed libexpseg.so's path:
                    LD_PRELOAD=$(python -m expseg --lib) python train.py
  -h, --help      this text
  -V, --version   expseg's version

In Python: import expseg; expseg.active(), expseg.stats(), expseg.pause(), expseg.resume(),
expseg.paused(), expseg.trim(), with expseg.tag(NAME): ...
The EXPSEG_* variables are listed in docs/configuration.md."""

# Commands answered by a launcher script of the package, and the script.
SCRIPTS = {"run": "expseg-run", "srun": "expseg-srun", "report-merge": "expseg-report-merge"}


def _tool(name):
    path = os.path.join(_LIB_DIR, name)
    if not os.path.isfile(path):
        sys.stderr.write(f"expseg: {path} is missing: the package was installed without its tools\n")
        raise SystemExit(127)
    return path


def _env():
    env = dict(os.environ)
    if not env.get("EXPSEG_LIB"):
        try:
            env["EXPSEG_LIB"] = library_path()
        except FileNotFoundError as e:
            sys.stderr.write(f"expseg: {e}\n")
            raise SystemExit(127)
    return env


def _exec(argv):
    try:
        os.execve(argv[0], argv, _env())
    except OSError as e:
        sys.stderr.write(f"expseg: cannot run {argv[0]}: {e}\n")
        return 126


def _script(name, args):
    # Through bash (and Python): no reliance on the installed file's mode bits.
    if name == "expseg-report-merge":
        return _exec([sys.executable, _tool(name)] + args)
    return _exec(["/bin/bash", _tool(name)] + args)


def _unknown(what, word):
    sys.stderr.write(f"expseg: unknown {what} '{word}' (see 'expseg --help')\n")
    return 2


def main(argv=None):
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (expseg --help | head): no traceback, as other tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(args):
    if not args:
        sys.stderr.write(USAGE + "\n")
        return 2
    cmd, rest = args[0], args[1:]
    if cmd in ("-h", "--help") or (cmd == "help" and rest in ([], ["help"])):
        print(USAGE)
        return 0
    if cmd in ("-V", "--version"):
        print(f"expseg {__version__}")
        return 0
    if cmd == "--lib":
        if rest:
            sys.stderr.write(f"expseg --lib: unknown argument '{rest[0]}' (see 'expseg --help')\n")
            return 2
        try:
            print(library_path())
        except FileNotFoundError as e:
            sys.stderr.write(f"expseg: {e}\n")
            return 1
        return 0
    if cmd == "help" and rest[0] in SCRIPTS:
        if len(rest) > 1:
            sys.stderr.write(f"expseg help: unknown argument '{rest[1]}' (see 'expseg help --help')\n")
            return 2
        return _script(SCRIPTS[rest[0]], ["--help"])
    if cmd in SCRIPTS:
        return _script(SCRIPTS[cmd], rest)
    if cmd.startswith("-"):
        return _unknown("option", cmd)
    return _exec([_tool("expseg")] + args)


def run():
    return _script("expseg-run", sys.argv[1:])


def srun():
    return _script("expseg-srun", sys.argv[1:])


def report_merge():
    return _script("expseg-report-merge", sys.argv[1:])
