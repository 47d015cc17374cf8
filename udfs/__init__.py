"""pandas UDFs shipped to Spark executors. Import-light: heavy libraries load lazily."""
