use dblock::Held;

fn post(_held: Held<'_>) {}

fn main() {
    // Only the library makes proofs: its fields are private.
    post(Held { locks: &[], kind: std::marker::PhantomData });
}
