//! recipe_core: reading recipe dumps, rendering, tokenizing and batching, without Python.

pub mod sample;
