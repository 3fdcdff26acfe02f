import os

from hypothesis import HealthCheck, settings

# FKV_DEEP=1 runs the property tests much longer than the default suite does
settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("deep" if os.environ.get("FKV_DEEP") else "default")
