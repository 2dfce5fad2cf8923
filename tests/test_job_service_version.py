"""The job service's version is its contract (docs/bus-api.md, "Versions"): what it
announces is what the docs say, and each version's change is listed there."""

from __future__ import annotations

from tandem.gateway import jobs
from tests.conftest import ROOT


def test_the_announced_job_service_version_is_documented_with_its_change() -> None:
    text = (ROOT / "docs/bus-api.md").read_text()
    section = text.split("## Job service (tandem-jobs)", 1)[1].split("\n## ", 1)[0]
    assert f"version\n`{jobs.VERSION}`," in section
    assert f"now `{jobs.VERSION}`)" in section
    changes = section.split("- **Changes**:", 1)[1].split("\n- **", 1)[0]
    assert f"  - `{jobs.VERSION}`: " in changes
    # 2.0.0: record_subject no longer carries the record (a meaning changed: major)
    assert int(jobs.VERSION.split(".")[0]) >= 2 and "`record_subject`" in changes
