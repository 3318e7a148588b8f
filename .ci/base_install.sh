#!/usr/bin/env bash
# The base package alone (no extras) in a fresh venv: every import it needs is declared, and the
# credit pipeline runs on a synthetic table. Any failure fails CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python -m venv "$venv"
"$venv/bin/pip" install --quiet .
work="$(dirname "$venv")/work"
"$venv/bin/graft" --help >/dev/null
"$venv/bin/graft" synth "$work/synth" --groups 4 --group-size 4
"$venv/bin/graft" advantage "$work/synth/steps.parquet" -o "$work/credit"
test -s "$work/credit/advantages.parquet"
echo "ci: base install ok"
