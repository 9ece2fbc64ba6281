//! The crd-broker binary (built out in the core broker issue).

fn main() {}
