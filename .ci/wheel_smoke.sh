#!/usr/bin/env bash
# Packaging check: build the wheel as a user's `pip install .` would, install it NON-editable into a second virtual
# environment and run the CLI from a folder outside the checkout, so a packaging defect (a missing data file, an
# import that only works because the editable-install hook ran first) cannot hide behind `pip install -e`.
#
# Run with the CI venv active (its python has the dependencies). The second venv sees the CI venv's site-packages
# through a plain path line in a .pth file: a fresh dependency install would take minutes, and a path added that way
# does not run the CI venv's own .pth files, so its editable specgraft hook stays off. specgraft itself comes only
# from the wheel (checked below).
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd -P)

work=$(mktemp -d "${TMPDIR:-/tmp}/specgraft-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$SECONDS

# 1. Build from a copy of the files git knows (tracked + untracked-not-ignored): a stale build/ or egg-info in the
#    checkout cannot leak into the wheel, and the wheel is what a fresh clone would build.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -cf - -T - 2>/dev/null | tar -xf - -C "$work/src"
python -m pip wheel --quiet --no-deps "$work/src" -w "$work/dist"
wheel=$(ls "$work"/dist/specgraft-*.whl)
echo "built $(basename "$wheel") ($(( SECONDS - started )) s)"

# 2. The wheel holds exactly the package's files: every module and every data file it reads at run time
#    (the embedded default target specgraft/defaults/model/*, specgraft/export/FORMATS.md, ...), nothing stale.
python - "$wheel" "$work/src" <<'EOF'
import sys
import zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("specgraft/")}
in_tree = {p.relative_to(src).as_posix() for p in (src / "specgraft").rglob("*")
           if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
required = {"specgraft/defaults/model/config.json", "specgraft/defaults/model/model.safetensors",
            "specgraft/defaults/model/tokenizer.json", "specgraft/defaults/model/training_report.json",
            "specgraft/export/FORMATS.md",
            "specgraft/demos/heads/smollm2-135m-instruct-eagle3/head.safetensors"}
missing, stray = sorted(in_tree - in_wheel), sorted(in_wheel - in_tree)
if missing or stray or not required <= in_wheel:
    sys.exit(f"wheel content mismatch: missing {missing or sorted(required - in_wheel)}, not in the tree {stray}")
print(f"wheel holds all {len(in_tree)} package files ({len(in_tree - {p for p in in_tree if p.endswith('.py')})} "
      "data files)")
EOF

# 3. A second venv with the wheel installed non-editable; dependencies from the CI venv (see the header).
python -m venv --without-pip "$work/venv"
venv_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# In the CI venv's order (a venv made with --system-site-packages lists the system's after its own).
python -c 'import site; print("\n".join(site.getsitepackages()))' | awk '!seen[$0]++' > "$venv_site/ci-venv-deps.pth"
python -m pip --python "$work/venv/bin/python" install --quiet --no-deps --ignore-installed "$wheel"

# 4. The CLI from outside the checkout, with nothing of the checkout on the path.
mkdir "$work/run"
cd "$work/run"
unset PYTHONPATH
export PATH="$work/venv/bin:$PATH" OMP_NUM_THREADS=1
location=$(python -c 'import specgraft; print(specgraft.__file__)')
case "$location" in
    "$work/venv/"*) ;;
    *) echo "specgraft imported from $location, not from the installed wheel" >&2; exit 1 ;;
esac
[ "$(command -v specgraft)" = "$work/venv/bin/specgraft" ] || { echo "specgraft script not from the wheel" >&2; exit 1; }
case "$location" in "$checkout/"*) echo "specgraft imported from the checkout" >&2; exit 1 ;; esac

# `specgraft --help` in a process of its own: nothing heavy imported first can mask a missing import there.
specgraft --help > top-help.txt
mapfile -t commands < <(python -c 'from specgraft.cli import COMMANDS; print("\n".join(COMMANDS))')
for command in "${commands[@]}"; do
    grep -Eq "^    $command( |$)" top-help.txt || { echo "specgraft --help does not list $command" >&2; exit 1; }
done
# Each subcommand's --help through the installed entry point, in one interpreter (one torch import, not ten:
# under load each process spends ~20 s importing).
python - "${commands[@]}" <<'PY'
import contextlib
import io
import sys
from importlib.metadata import entry_points

(entry,) = [e for e in entry_points(group="console_scripts") if e.name == "specgraft"]
main = entry.load()
for argv in [[c, "--help"] for c in sys.argv[1:]] + [["recipe", "check", "--help"], ["recipe", "show", "--help"]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
            code = 0
        except SystemExit as stop:
            code = stop.code
    if code != 0 or "usage: specgraft" not in out.getvalue():
        sys.exit(f"`specgraft {' '.join(argv)}` exited {code} without its usage text")
PY
echo "specgraft --help and ${#commands[@]} subcommands' --help ran from the wheel ($(( SECONDS - started )) s so far)"

specgraft demo --quick --out "$work/demo" > demo.log 2>&1 || { tail -n 30 demo.log >&2; exit 1; }
[ -s "$work/demo/summary.md" ] || { echo "specgraft demo --quick wrote no summary.md" >&2; exit 1; }
echo "specgraft demo --quick ran from the wheel; the wheel smoke test took $(( SECONDS - started )) s"
