"""The recorder and the knobs of the fake runtime."""
calls: list[tuple[str, object]] = []
available = True
device_count = 8
device_name = "GAUDI2"
graph_compilations = 0
import_env: dict[str, str] = {}  # the PT_HPU_* variables habana_frameworks.torch saw at import
memory = {"InUse": 3 * 1024**3, "MaxInUse": 5 * 1024**3, "Limit": 94 * 1024**3, "NumAllocs": 7}


def record(name: str, details: object = None) -> None:
    calls.append((name, details))


def names() -> list[str]:
    return [name for name, _ in calls]
