package kvledger.examples.violations;

import java.io.IOException;
import java.util.HexFormat;
import java.util.List;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.MissingSchemaException;

/**
 * A record value of the violations topic, by its framing (schemas/codec.py):
 *
 * <ul>
 *   <li>{@code C3 01} + the writer schema's 8-byte CRC-64-AVRO fingerprint + body: Avro
 *       single-object encoding, the project's default, which Avro's message decoder reads as is;
 *   <li>{@code 00} + a 4-byte schema id + body: the Confluent framing, when the workers publish
 *       through a Schema Registry (see {@link ConfluentRegistry}).
 * </ul>
 *
 * Either way the body is resolved against the reader schema, violation.avsc.
 */
final class ViolationDecoder {
    private final BinaryMessageDecoder<GenericRecord> singleObject;
    private final ConfluentRegistry registry;

    /** {@code writers}: older writer schemas to accept besides the reader's own; registry may be null. */
    ViolationDecoder(Schema reader, List<Schema> writers, ConfluentRegistry registry) {
        this.singleObject = new BinaryMessageDecoder<>(GenericData.get(), reader);
        writers.forEach(singleObject::addSchema);
        this.registry = registry;
    }

    GenericRecord decode(byte[] value) throws UndecodableRecordException {
        if (value == null || value.length == 0) {
            throw new UndecodableRecordException("empty record");
        }
        if (value.length >= 2 && value[0] == (byte) 0xC3 && value[1] == 0x01) {
            return decodeSingleObject(value);
        }
        if (value[0] == 0x00) {
            if (registry == null) {
                throw new UndecodableRecordException(
                        "a Confluent-framed record (00 + schema id): pass the Schema Registry with --registry URL");
            }
            return registry.decode(value);
        }
        throw new UndecodableRecordException(String.format(
                "neither single-object (C3 01) nor Confluent (00) framing: starts with %02x", value[0]));
    }

    private GenericRecord decodeSingleObject(byte[] value) throws UndecodableRecordException {
        try {
            return singleObject.decode(value);
        } catch (MissingSchemaException e) {
            String fingerprint = value.length >= 10 ? HexFormat.of().formatHex(value, 2, 10) : "(truncated)";
            throw new UndecodableRecordException("unknown writer schema fingerprint " + fingerprint
                    + " (not this violation.avsc; pass an older one with --writer-schema FILE)");
        } catch (IOException | RuntimeException e) {
            // Bad bytes surface as several exception types (truncation, negative lengths, limits).
            throw new UndecodableRecordException("undecodable Avro body: " + FatalError.rootCause(e));
        }
    }
}
