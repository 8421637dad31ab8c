# Sourced by the H200 ship scripts once they have set `out` (their OUT folder): the shipped
# table's path (`table`), OUT/logs (`logs`), the package installed from the working tree, and
# `pack`, which puts the logs in OUT/logs.tgz for the device to send back.
table=results/tables/nvidia-h200-sm90.yaml
logs=$out/logs; mkdir -p "$logs"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$logs/install.txt" 2>&1
pack() { tar czf "$out/logs.tgz" -C "$out" logs; }
