"""Hypothesis strategies over every sampled churn model, shared by the failure-sampling tests."""

from __future__ import annotations

from hypothesis import strategies as st

from churnsim.calibration.churn import BurstChurn, PoissonChurn, StageHourlyChurn, TraceChurn, WeibullChurn

P3 = {"kind": "trace", "path": "bamboo/p3-trace.csv", "format": "bamboo_csv"}
"""The Bamboo p3 spot trace shipped with the package."""


def churn_configs(*, max_events_per_hour: float, min_mean_lifetime_s: float, min_time_scale: float) -> st.SearchStrategy:
    """Poisson, stage-hourly, Weibull, burst and p3-trace churn, at most `max_events_per_hour`
    failures (or bursts) per node-hour, Weibull lifetimes of at least `min_mean_lifetime_s` and the
    trace compressed at most to `min_time_scale` (the bounds keep a path's length manageable)."""
    return st.one_of(
        st.builds(PoissonChurn, kind=st.just("poisson"), failures_per_node_hour=st.floats(0.0, max_events_per_hour)),
        st.builds(StageHourlyChurn, kind=st.just("stage_hourly"), failure_probability_per_stage_hour=st.floats(0.0, 0.9)),
        st.builds(WeibullChurn, kind=st.just("weibull"), shape=st.floats(0.3, 5.0), mean_lifetime_s=st.floats(min_mean_lifetime_s, 1e5)),
        st.builds(BurstChurn, kind=st.just("burst"), bursts_per_hour=st.floats(0.0, max_events_per_hour)),
        st.builds(
            TraceChurn, kind=st.just("trace"), path=st.just(P3["path"]), format=st.just("bamboo_csv"),
            time_scale=st.floats(min_time_scale, 3.0), window_start_s=st.sampled_from([0.0, 3600.0, 20000.0]), repeat=st.booleans(),
        ),
    )
