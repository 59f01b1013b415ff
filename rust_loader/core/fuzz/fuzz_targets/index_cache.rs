#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| recipe_core_fuzz::index_cache(data));
