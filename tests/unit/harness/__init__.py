# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
"""The test harness of the patch series, by concern (the conftest registers its fixtures and hooks)."""
