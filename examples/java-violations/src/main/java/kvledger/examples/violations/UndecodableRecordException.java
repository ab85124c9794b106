package kvledger.examples.violations;

/** One record that is not a readable violation: counted and skipped, never fatal. */
final class UndecodableRecordException extends Exception {
    private static final long serialVersionUID = 1L;

    UndecodableRecordException(String message) {
        super(message, null, false, false);
    }
}
