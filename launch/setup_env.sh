# Sourced by examples/quickstart/quickstart.sh and launch/test.sh: create .venv on first use and install
# the pinned requirements (torch first: on the CPU boxes it comes from local disk), then
# megablu itself (editable). Idempotent: a marker records the installed requirements hash.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -x "$root/.venv/bin/python" ]; then
  python3 -m venv "$root/.venv" >&2
fi
# shellcheck disable=SC1091
source "$root/.venv/bin/activate"
want=$(cat "$root/requirements.txt" "$root/setup.py" "$root/pyproject.toml" | sha256sum | cut -c1-16)
if [ "$(cat "$root/.venv/.megablu-req" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip >&2
  python -m pip install -q "$(grep '^torch==' "$root/requirements.txt")" >&2
  python -m pip install -q -r "$root/requirements.txt" >&2
  python -m pip install -q --no-deps -e "$root" >&2
  echo "$want" > "$root/.venv/.megablu-req"
fi
