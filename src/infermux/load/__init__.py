"""Load generation after MLPerf LoadGen: scenarios, seeded arrivals and validity rules.

The load generator knows queries and sample indices only; the query sample library (QSL) holds
the data and the system under test (SUT) runs it. The two meet through `SystemUnderTest`.
"""

from infermux.load.base import Query, QuerySampleLibrary, SystemUnderTest
from infermux.load.scenarios import (
    LoadGenerator,
    PeakResult,
    ScenarioResult,
    find_peak,
    poisson_schedule,
)

__all__ = [
    "LoadGenerator",
    "PeakResult",
    "Query",
    "QuerySampleLibrary",
    "ScenarioResult",
    "SystemUnderTest",
    "find_peak",
    "poisson_schedule",
]
