//! Seeded generator of realistic recipes in the real dumps' formats (owned by the sample-data work).
