# Licensed under the Apache License, Version 2.0 (the "License"); see the Apache Airflow project.
